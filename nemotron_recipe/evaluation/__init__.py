"""Evaluation of native models through the lm-eval harness (`recipes.evaluate`, `eval.tasks`).

Nothing here imports lm_eval at package import: the harness is an optional dependency
(`pip install -e '.[eval]'`), loaded only when an evaluation runs.
"""
