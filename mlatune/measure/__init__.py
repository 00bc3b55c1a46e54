"""Measuring a route: the timers (``timing``) and the typed records a measurement makes,
folded into table rows (``records``). Below both the tuner and the runtime."""
