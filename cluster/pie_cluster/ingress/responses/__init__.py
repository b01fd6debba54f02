"""OpenAI's Responses API: routes, objects and stream events, and conversations parked between turns."""
