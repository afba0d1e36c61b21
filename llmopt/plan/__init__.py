"""The memory and speed model behind `llmopt recommend`."""
