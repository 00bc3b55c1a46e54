"""mlatune as SGLang's MLA decode attention backend (docs/engines/sglang.md).

SGLang runs ``register`` through its general-plugin entry point at start-up, in every
process, before it parses the command line: it registers the backend's factory under
the name ``mlatune`` and adds that name to the choices of ``--attention-backend``,
``--decode-attention-backend`` and ``--prefill-attention-backend``. Nothing here imports
SGLang or mlatune's runtime until ``register`` runs or a model loads; the backend itself
is ``mlatune.integrations.sglang.backend`` (it imports SGLang).
"""

from __future__ import annotations

BACKEND_NAME = "mlatune"
INSTALL_HINT = ("mlatune's SGLang backend needs SGLang: pip install 'mlatune[sglang]' "
                "(SGLang 0.5.23 or newer)")


def register() -> None:
    """Register the backend with SGLang (idempotent): the factory in SGLang's attention
    backend registry and the name among the command line's backend choices."""
    try:
        from sglang.srt.arg_groups.choices import (
            ATTENTION_BACKEND_CHOICES,
            add_attention_backend_choices,
        )
        from sglang.srt.layers.attention.attention_registry import (
            register_attention_backend,
        )
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    register_attention_backend(BACKEND_NAME)(create_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])


def create_backend(runner):
    """SGLang's factory for ``--decode-attention-backend mlatune``: mlatune's backend for
    the model ``runner`` loaded, or, where mlatune cannot serve it, SGLang's fallback
    backend (``backend.create_backend`` says which)."""
    from mlatune.integrations.sglang.backend import create_backend as create

    return create(runner)
