"""Every node of a Ray cluster, through a small agent actor on each.

The driver reads its own machine directly; what lives on another node (processes a crashed run
left there, that node's kernel log and GPU state) is read by an agent pinned to that node. One
agent per alive node, started when first needed, holding no resources (``num_cpus=0``), so it
never takes a GPU or CPU bundle a server needs.

Leftovers (see ``orchestrator.cluster.leftovers``) are judged with the same run and driver tags as
on one machine: every agent lists the marked processes of its machine, and a process is a
leftover when its driver is gone, asked on the driver's own host. Nodes that share one process
table (several raylets on one host) are scanned once, and each process is reported on the node
that started it where that node is still there.
"""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Iterable
from typing import Any

from orchestrator.cluster.leftovers import (
    Leftover,
    driver_alive,
    machine_id,
    marked_processes,
    stop_leftovers,
)

# What an agent may run for the driver: the readers of a node's fault sources (the audit's
# kernel log and GPU state), nothing else.
NODE_COMMANDS = frozenset({"journalctl", "dmesg", "nvidia-smi"})
# One answer from an agent; a node that takes longer is reported as not answering.
AGENT_TIMEOUT_S = 60.0
# A command on a node (the kernel log of a busy machine can take a while to read).
COMMAND_TIMEOUT_S = 120.0


class _NodeAgent:
    """Lives on one node; reads that node for the driver. (Wrapped by ray.remote.)"""

    def identity(self) -> dict[str, str]:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "machine": machine_id(),
        }

    def scan(self) -> tuple[dict[str, str], list[Leftover]]:
        """Who this node is, and the marked processes of its machine."""
        ident = self.identity()
        return ident, marked_processes(node=ident["node_ip"])

    def drivers_alive(self, tags: list[str]) -> dict[str, bool | None]:
        return {tag: driver_alive(tag) for tag in tags}

    def stop(self, leftovers: list[Leftover], grace_s: float) -> list[Leftover]:
        return stop_leftovers(leftovers, grace_s=grace_s)

    def run(self, argv: list[str]) -> dict[str, Any]:
        if not argv or argv[0] not in NODE_COMMANDS:
            raise ValueError(f"not a node command: {argv[:1]}")
        try:
            out = subprocess.run(
                argv, capture_output=True, text=True, errors="replace", timeout=COMMAND_TIMEOUT_S
            )
        except FileNotFoundError:
            return {"missing": True}
        return {"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}


def completed(argv: list[str], answer: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """An agent's answer to `run` as the subprocess result the audit's readers expect
    (orchestrator.audit.sources)."""
    if answer.get("missing"):
        raise FileNotFoundError(argv[0])
    return subprocess.CompletedProcess(
        argv, answer["returncode"], stdout=answer["stdout"], stderr=answer["stderr"]
    )


def pick_reports(
    scans: Iterable[tuple[dict[str, str], list[Leftover]]],
) -> list[tuple[str, Leftover]]:
    """One report per process from every node's scan: ``(machine, leftover)``.

    Nodes on one machine see the same processes; the report kept is the one from the node
    whose id the process carries (the node that started it), else the first.
    """
    chosen: dict[tuple[str, int], tuple[str, Leftover]] = {}
    for ident, found in scans:
        for p in found:
            key = (ident["machine"], p.pid)
            if key not in chosen or p.started_by == ident["node_id"]:
                chosen[key] = (ident["machine"], p)
    return sorted(chosen.values(), key=lambda mp: (mp[1].node or "", mp[1].pid))


class ClusterNodes:
    """The agents of one run, one per alive node, keyed by Ray node id."""

    def __init__(self, ray: Any, log: Callable[[str], None] = print) -> None:
        self._ray = ray
        self.log = log
        self._cls = ray.remote(num_cpus=0, max_restarts=0)(_NodeAgent)
        self._agents: dict[str, Any] = {}
        self._identity: dict[str, dict[str, str]] = {}
        # Which machine's agent stops a leftover it reported.
        self._machine_of: dict[Leftover, str] = {}

    def _agent(self, node_id: str) -> Any:
        if node_id not in self._agents:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            self._agents[node_id] = self._cls.options(scheduling_strategy=strategy).remote()
        return self._agents[node_id]

    def _alive_node_ids(self) -> list[str]:
        return [n["NodeID"] for n in self._ray.nodes() if n.get("Alive")]

    def _ask_all(self, method: str, *args: Any) -> list[tuple[str, Any]]:
        """Call `method` on every alive node's agent at once; a node that does not answer is
        logged and left out (a lost node cannot hold up the run)."""
        calls = []
        for node_id in self._alive_node_ids():
            agent = self._agent(node_id)
            calls.append((node_id, getattr(agent, method).remote(*args)))
        answers = []
        for node_id, ref in calls:
            try:
                answers.append((node_id, self._ray.get(ref, timeout=AGENT_TIMEOUT_S)))
            except Exception as exc:  # GetTimeoutError, the node or its agent died, ...
                self.log(f"warning: node {node_id[:12]} did not answer ({method}): {exc}")
                self._agents.pop(node_id, None)
        return answers

    def find_leftovers(self) -> list[Leftover]:
        """Processes of runs whose orchestrator is gone, on every node of the cluster."""
        scans = [answer for _, answer in self._ask_all("scan")]
        self._identity = {ident["node_id"]: ident for ident, _ in scans}
        reports = pick_reports(scans)
        alive = self._drivers_alive({p.driver for _, p in reports}, self._identity)
        leftovers = []
        for machine, p in reports:
            if alive.get(p.driver) is False:
                self._machine_of[p] = machine
                leftovers.append(p)
        return leftovers

    def _drivers_alive(
        self, tags: set[str], idents: dict[str, dict[str, str]]
    ) -> dict[str, bool | None]:
        """Each driver tag judged on its own host: here, or by an agent on that host; None
        where no node of the cluster is that host (not ours to judge)."""
        by_host = {ident["hostname"]: node_id for node_id, ident in idents.items()}
        judged: dict[str, bool | None] = {}
        remote: dict[str, list[str]] = {}
        for tag in tags:
            host = tag.partition(":")[0]
            if host == socket.gethostname():
                judged[tag] = driver_alive(tag)
            elif host in by_host:
                remote.setdefault(by_host[host], []).append(tag)
            else:
                judged[tag] = None
        for node_id, node_tags in remote.items():
            try:
                judged.update(
                    self._ray.get(
                        self._agent(node_id).drivers_alive.remote(node_tags),
                        timeout=AGENT_TIMEOUT_S,
                    )
                )
            except Exception as exc:
                self.log(f"warning: could not ask node {node_id[:12]} about its drivers: {exc}")
        return judged

    def stop_leftovers(
        self, leftovers: Iterable[Leftover], grace_s: float = 10.0
    ) -> list[Leftover]:
        """Stop leftovers found by find_leftovers, each through an agent on its machine;
        returns those that could not be stopped."""
        agent_of_machine = {ident["machine"]: node_id for node_id, ident in self._identity.items()}
        groups: dict[str, list[Leftover]] = {}
        stuck: list[Leftover] = []
        for p in leftovers:
            node_id = agent_of_machine.get(self._machine_of.get(p, ""))
            if node_id is None:
                stuck.append(p)
            else:
                groups.setdefault(node_id, []).append(p)
        calls = [
            (group, self._agent(node_id).stop.remote(group, grace_s))
            for node_id, group in groups.items()
        ]
        for group, ref in calls:
            try:
                stuck += self._ray.get(ref, timeout=grace_s + AGENT_TIMEOUT_S)
            except Exception as exc:
                self.log(f"warning: stopping leftovers on {group[0].node}: {exc}")
                stuck += group
        return stuck

    def command_runner(
        self, node_id: str
    ) -> Callable[[list[str]], subprocess.CompletedProcess[str]]:
        """Runs the audit's readers (kernel log, GPU state: orchestrator.audit.sources) on
        `node_id` instead of here."""

        failed: list[str] = []  # once a node did not answer, the next reader is not kept waiting

        def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
            if failed:
                raise OSError(failed[0])
            try:
                answer = self._ray.get(
                    self._agent(node_id).run.remote(list(argv)),
                    timeout=COMMAND_TIMEOUT_S + AGENT_TIMEOUT_S,
                )
            except Exception as exc:
                self._agents.pop(node_id, None)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                failed.append(f"node {node_id[:12]} did not answer: {first[:200]}")
                raise OSError(failed[0]) from None
            return completed(argv, answer)

        return run
