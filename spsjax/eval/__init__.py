"""Evaluation: HumanEval completions run in a sandbox, ROUGE-2, and a sampling-noise check.

`execution` runs untrusted completions against HumanEval's tests (pass@1, parse rate, the stop
rule that truncates a completion); `metrics` has ROUGE-2 and mean ± standard error for comparing
ArS with SpS. Import the submodules: `from spsjax.eval import execution, metrics`.
"""
