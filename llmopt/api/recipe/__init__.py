"""Recipes (`llmopt run recipe.yaml`): one source, many outputs, shared steps, gates, a manifest.

`schema.py` is the recipe's typed shape, `load.py` reads YAML into it (errors with
file:line:column), `plan.py` resolves paths, fingerprints and shared steps, `run.py` makes the
outputs (resumable), and `manifest.py` writes what a run leaves behind. docs/ci.md shows it in CI.
"""
