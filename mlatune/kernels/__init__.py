"""Portable Triton kernels behind the ``*/triton`` routes.

Modules here import Triton at import time; routes import them lazily (in
``prepare``) so that ``import mlatune.routes`` works without Triton and so that
tests can switch on ``TRITON_INTERPRET`` before any kernel is decorated.
"""
