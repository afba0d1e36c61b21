"""The one place that turns the library's option names into this CLI's flags.

Library errors name settings by field (`OptionError("<group_size> 0 ...")`); the CLI shows the
flag a user typed. Most flags are the field with dashes; the exceptions are listed here.
"""

from __future__ import annotations

FLAGS = {
    "fmt": "--format",
    "mix": "--type",
    "group_aware": "--group-aware-order",
    "tensor_types": "--tensor-type",
    "output": "-o/--output",
    "max_tokens": "--max-tokens",
    "clip": "--no-clip",  # the only flag that changes it
    "served_model": "--model",  # bench --endpoint: the name the server knows the model by
}


def flag(field: str) -> str:
    """The flag that sets `field`."""
    return FLAGS.get(field, "--" + field.replace("_", "-"))
