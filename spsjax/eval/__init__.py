"""Evaluation: Table 1's tasks and their scores, and alpha along generated text.

`tasks` loads Table 1's tasks and scores their completions; `execution` runs untrusted completions
against HumanEval's tests (pass@1, parse rate, the stop rule that truncates a completion);
`metrics` has ROUGE-2 and mean ± standard error for comparing ArS with SpS; `acceptance` measures
a target/draft pair's alpha on the text a task's prompts lead to. Import the submodules:
`from spsjax.eval import acceptance, execution, metrics, tasks`.
"""
