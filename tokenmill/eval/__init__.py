"""`tokenmill eval`: a quality report comparing engine configurations with a reference one.

configs.py names the configurations, perplexity.py, agreement.py and questions.py measure, and
report.py runs them and prints the table; docs/quantization.md explains each figure.
"""
