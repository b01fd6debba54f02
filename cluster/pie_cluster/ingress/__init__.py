"""The HTTP front door, served by Ray Serve: the launch endpoint, the OpenAI-compatible and Responses routes,
and the cluster's own programs run in the ingress replica's process."""
