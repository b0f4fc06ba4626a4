"""Test hosts on one machine: two network namespaces joined by a veth pair (plus, if asked, hosts
with no link at all), each with its own hostname and /etc/hosts, and an "ssh" for mpiexec that
enters the target namespace instead of logging in (recipe: ../shared/RECIPES.md, "Several hosts on
one machine"). Needs root, `ip` (iproute2) and `unshare` (util-linux).

    hosts = NetnsHosts(tmp_path)         # hosts.names == ["sr<pid>a", "sr<pid>b"]
    subprocess.run(hosts.inside(0, [...]))   # a command run on host 0 (mpiexec, or shardrec-run)
    hosts.mpiexec_args()                 # Open MPI options: the agent, TCP on the test subnet only
    hosts.cut(1) / hosts.restore(1)      # take host 1's link down / up
    hosts.kill(1)                        # kill every process on host 1
    hosts.close()
"""
import os
import shutil
import subprocess

from shardrec.orchestrator import job_kill

AGENT = """#!/bin/sh
# mpiexec's "ssh": [options] HOST COMMAND... -> COMMAND run inside the namespace named HOST.
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
exec ip netns exec "$host" unshare --mount --uts sh -c \
  'hostname "$0"; mount --bind {hosts_file} /etc/hosts; exec sh -c "$*"' "$host" "$@"
"""


def _ip(*args):
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()} (these tests need root, iproute2 and "
                           f"util-linux: apt-get install iproute2 util-linux)")


class NetnsHosts:
    def __init__(self, directory, unreachable=0, linked=2):
        """`linked` hosts that reach each other (2: a veth pair; more: each on a bridge of its own
        here), and `unreachable` more with no link at all (hosts that never answer)."""
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} not found: these tests need iproute2 and util-linux")
        tag = f"sr{os.getpid() % 100000}"
        self.names = [f"{tag}{chr(ord('a') + i)}" for i in range(linked + unreachable)]
        self.linked = linked
        self.bridge = f"{tag}-br" if linked > 2 else None
        self.subnet = f"10.{77 + os.getpid() % 100}.0"
        self.address = {name: f"{self.subnet}.{i + 1}" for i, name in enumerate(self.names)}
        self.created = []
        os.makedirs(directory, exist_ok=True)
        self.hosts_file = os.path.join(directory, "hosts")
        self.agent = os.path.join(directory, "agent.sh")
        try:
            for name in self.names:
                _ip("netns", "add", name)
                self.created.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
            if self.bridge:
                _ip("link", "add", self.bridge, "type", "bridge")
                _ip("link", "set", self.bridge, "up")
                for name in self.names[:linked]:
                    _ip("link", "add", f"{name}-v", "type", "veth", "peer", "name", f"{name}-p")
                    _ip("link", "set", f"{name}-p", "master", self.bridge)
                    _ip("link", "set", f"{name}-p", "up")
            else:
                a, b = self.names[:2]
                _ip("link", "add", f"{a}-v", "type", "veth", "peer", "name", f"{b}-v")
            for name in self.names[:linked]:
                _ip("link", "set", f"{name}-v", "netns", name)
                _ip("-n", name, "addr", "add", f"{self.address[name]}/24", "dev", f"{name}-v")
                _ip("-n", name, "link", "set", f"{name}-v", "up")
        except Exception:
            self.close()
            raise
        with open(self.hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for n, a in self.address.items()))
        with open(self.agent, "w") as f:
            f.write(AGENT.replace("{hosts_file}", self.hosts_file))
        os.chmod(self.agent, 0o755)

    def inside(self, index, command):
        """`command` (a list) as run on host `index`."""
        return [self.agent, self.names[index], *command]

    def mpiexec_args(self):
        """Each namespace "host" believes it owns every core, so Open MPI would bind the first rank of
        each to core 0 and the two ranks would share one core: no binding (RECIPES.md)."""
        net = f"{self.subnet}.0/24"
        return ["--bind-to", "none", "--mca", "plm_rsh_agent", self.agent, "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", net, "--mca", "oob_tcp_if_include", net]

    def hostfile(self, directory, hosts=None, slots=1):
        path = os.path.join(directory, "hostfile")
        with open(path, "w") as f:
            f.write("".join(f"{n} slots={slots}\n" for n in (hosts or self.names[:2])))
        return path

    def cut(self, index):
        """Takes host `index`'s end of its link down (a linked host)."""
        _ip("-n", self.names[index], "link", "set", f"{self.names[index]}-v", "down")

    def restore(self, index):
        _ip("-n", self.names[index], "link", "set", f"{self.names[index]}-v", "up")

    def kill(self, index):
        """Kills every process on host `index` (its Open MPI daemon and ranks): the host is gone."""
        pids = subprocess.run(["ip", "netns", "pids", self.names[index]], capture_output=True, text=True).stdout.split()
        _kill_and_clean(pids)
        return pids

    def close(self):
        """Kills what still runs inside the namespaces (a host whose link was cut keeps its Open MPI
        daemon: it never hears that the job ended), then deletes them."""
        for name in reversed(self.created):
            _kill_and_clean(subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split())
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created = []
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _kill_and_clean(pids):
    """SIGKILLs `pids` and removes their job's shared-memory segments (a killed host's daemon cannot);
    does not wait for them (their zombies are reaped by parents on the other hosts)."""
    job_kill.kill_job(pids, timeout=0)
