"""OpenAI's Chat Completions and Completions routes, their checks and their response objects."""
