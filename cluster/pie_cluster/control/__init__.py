"""The control plane's top: the controller that brings the cluster up and keeps its replicas alive (supervisor,
recovery after a restart), drains nodes and reports the cluster's status."""
