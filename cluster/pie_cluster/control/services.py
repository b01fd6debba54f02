"""What inferlets on each node reach: every model through that node's view of its replicas (ipc to a replica on the
same node, else tcp), the bus shards, MCP servers, the market, and the models' tokenizer files."""

from __future__ import annotations

from inferlet.mcp import ServerSpec
from inferlet.runtime import ModelEndpoint
from pie_workers.replica import Replica

from pie_cluster.bus import Bus
from pie_cluster.hosts.node_host import NodeServices


def model_endpoints(replicas: dict[str, list[Replica]], node_id: str) -> dict[str, ModelEndpoint]:
    """How an inferlet on ``node_id`` reaches each model: a same-node replica over ipc, else one over tcp (the
    same one for every inferlet of the node, a different one for different nodes)."""
    out = {}
    for name, group in replicas.items():
        local = [r for r in group if r.info.node_id == node_id]
        chosen = local[0] if local else group[hash(node_id) % len(group)]
        out[name] = endpoint(name, chosen, node_id)
    return out


def replica_endpoints(replicas: dict[str, list[Replica]], node_id: str) -> dict[str, tuple[ModelEndpoint, ...]]:
    """Every replica of each model as reached from ``node_id``, in replica order: what the ingress there spreads its
    own requests over (``ingress.routing``)."""
    return {name: tuple(endpoint(name, r, node_id) for r in group) for name, group in replicas.items()}


def node_services(
    replicas: dict[str, list[Replica]], bus: Bus, market, mcp_servers: dict[str, ServerSpec], nodes
) -> dict[str, NodeServices]:
    """Each node's ``NodeServices``; the models' tokenizer files are fetched anew (a dead replica's would be lost)."""
    model_files = {name: group[0].leader.model_files.remote() for name, group in replicas.items()}
    revokers = (*(r.leader for group in replicas.values() for r in group), *bus.shards)
    return {
        node: NodeServices(
            endpoints=model_endpoints(replicas, node),
            replicas=replica_endpoints(replicas, node),
            bus=bus.addresses(node),
            mcp_servers=mcp_servers,
            market=market,
            model_files=model_files,
            revokers=revokers,
        )
        for node in nodes
    }


def endpoint(name: str, replica: Replica, node_id: str) -> ModelEndpoint:
    """How an inferlet on ``node_id`` reaches ``replica``: over ipc on its node, else over tcp."""
    info = replica.info
    return ModelEndpoint(
        name=name,
        address=replica.addresses["ipc" if info.node_id == node_id else "tcp"],
        model_dir=info.model_dir,
        page_size=info.page_size,
        vocab_size=info.vocab_size,
        architecture=info.architecture,
    )
