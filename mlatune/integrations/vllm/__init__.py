"""mlatune's MLA decode backend for vLLM, found through the ``vllm.general_plugins`` entry
point: ``register`` maps ``--attention-backend CUSTOM`` to ``backend.MLATuneBackend``
(vLLM imports that class only when the flag selects it). docs/engines/vllm.md says what is
served and what is refused."""

from __future__ import annotations

import logging
from importlib.util import find_spec

if find_spec("vllm") is None:
    raise ImportError("mlatune.integrations.vllm needs vLLM: pip install 'mlatune[vllm]'")

BACKEND = "mlatune.integrations.vllm.backend.MLATuneBackend"
_LOG = logging.getLogger("vllm.mlatune")


def register() -> None:
    """Point vLLM's CUSTOM attention backend at mlatune's (the entry point's call, made in
    every vLLM process; calling it again changes nothing)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != BACKEND:
        _LOG.warning("mlatune: vLLM's CUSTOM attention backend was %s; now mlatune's",
                     custom.get_path())
    register_backend(custom, BACKEND)
