"""The answers' quality: HumanEval at equal LLM token rates, and how well each router finds divergent tokens."""
