"""Generation: prompt templates, the HF / vLLM / OpenAI engines, the lean decode step, the CPU attention
path, the tool-call protocol (tools.py) and the sandbox tool code runs in."""
