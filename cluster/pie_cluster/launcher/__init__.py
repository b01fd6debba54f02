"""The launcher: one named actor that owns programs, admits and places instances, and learns how each ended;
its records, admission, recovery after a restart, and what it knows of hosts and ingress replicas."""
