"""The sweep: specs, the runner and its worker processes, timing, the journal, plans."""
