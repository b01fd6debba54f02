"""How a driver (`pie start` / `pie stop` / `pie status`, tests, benches) starts, finds and stops the controller:
one named actor per Ray namespace."""

from __future__ import annotations

import ray
import ray.exceptions
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pie_cluster.config import PieConfig
from pie_cluster.control.controller import Controller
from pie_cluster.control.preferred_node import preferring
from pie_cluster.control.recovery import kill_saved
from pie_cluster.ray_session import CONTROLLER


def start_controller(config: PieConfig, detached: bool = True):
    """Create the controller in the current namespace (or return the running one) once every service is up, on
    the caller's node (`pie start` runs on the head)."""
    # beside the caller (the head, for `pie start`); a restartable one may go elsewhere, and is restarted on another
    # node when that one is lost (its state is in the GCS); one that is not would die with any node it landed on
    node = ray.get_runtime_context().get_node_id()
    options = {"name": CONTROLLER, "num_cpus": 0, "max_concurrency": 16, "get_if_exists": True}
    if detached:  # outlives the command, and is restarted (adopting what it built) when its process dies
        options |= {"lifetime": "detached", "max_restarts": -1, "max_task_retries": -1, **preferring(node)}
    else:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
    controller = ray.remote(Controller).options(**options).remote(config, restartable=detached)
    try:
        ray.get(controller.ready.remote())
    except ray.exceptions.RayActorError as e:  # its build failed (and took down what it had started)
        bare = str(e).strip() == ray.exceptions.ActorDiedError.BASE_ERROR_MSG  # its process died: Ray knows why
        why = death_cause(controller._actor_id.hex()) if bare else None
        ray.kill(controller)  # and its name goes with it: the next start is not handed this dead one
        if why is not None:
            raise RuntimeError(f"the controller died while starting: {why}") from e
        raise
    return controller


def death_cause(actor_id: str) -> str | None:
    """Why Ray says the actor died, from its state API (the first line of the error it recorded, and the last):
    what a bare "the actor died unexpectedly" leaves out. None when Ray recorded nothing or does not answer."""
    from ray.util.state import get_actor

    try:
        state = get_actor(actor_id, timeout=10)
    except Exception:  # the state API is best effort here: the caller has an error of its own to show
        return None
    for context in ((state.death_cause or {}) if state is not None else {}).values():
        if isinstance(context, dict):
            for key in ("error_message", "formatted_exception_string"):
                if lines := str(context.get(key) or "").strip().splitlines():
                    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return None


def find_controller():
    """The running controller of this namespace; a clear error when Pie was not started."""
    try:
        return ray.get_actor(CONTROLLER)
    except ValueError:
        raise RuntimeError("no Pie cluster is running in this Ray namespace: start one with `pie start`") from None


def stop_controller() -> bool:
    """Shut every service down and remove the controller; False when none was running. A controller that died or
    hangs is killed outright, and so is what it saved that it had started (the rest were its own actors and go with
    it)."""
    try:
        controller = ray.get_actor(CONTROLLER)
    except ValueError:
        return False
    try:
        ray.get(controller.shutdown.remote(), timeout=120)
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):  # what it started may be detached: by hand
        kill_saved(ray.get_runtime_context().namespace)
    ray.kill(controller)
    return True
