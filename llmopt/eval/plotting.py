"""matplotlib, optional: the plots (`eval --plot`, `bench --plot`) ask for it here, one way."""

from __future__ import annotations

from typing import Any

from llmopt.errors import OptionError


def require_matplotlib() -> Any:
    """pyplot on the Agg backend (files, no display), or a one-line OptionError naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OptionError("<plot> needs matplotlib: pip install 'llmopt[plot]'") from None
    return plt
