"""Evaluation: perplexity and latency (measure), retained performance (retained), the lm-eval benchmark table and harness glue, offline task folders (tasks)."""
