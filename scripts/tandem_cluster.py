"""What the benchmark scripts share: a cluster from a cluster.toml text started with
`tandem up` (and stopped), and GETs of its JSON endpoints."""
import contextlib
import http.client
import json
import os
import re
import subprocess
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# The binary under test (`TANDEM_EXE` names another build, e.g. to compare before and after).
EXE = os.environ.get("TANDEM_EXE") or os.path.join(ROOT, "target", "release", "tandem")


@contextlib.contextmanager
def cluster(config, prefix="tandem-bench-"):
    """Starts `tandem up` on `config` (the text of a cluster.toml) in a scratch directory;
    yields (the router's host:port, the directory); stops the cluster on the way out."""
    d = tempfile.mkdtemp(prefix=prefix)
    cfg = os.path.join(d, "cluster.toml")
    with open(cfg, "w") as f:
        f.write(config)
    up = subprocess.Popen([EXE, "up", "--config", cfg], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
    try:
        addr = next(m.group(1) for line in up.stdout if (m := re.search(r"behind http://(\S+)", line)))
        yield addr, d
    finally:
        up.send_signal(2)
        try:
            up.wait(timeout=15)
        except subprocess.TimeoutExpired:
            up.kill()


def get_json(addr, path):
    """GET `path` from the router at `addr` (host:port), parsed."""
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        c.request("GET", path)
        return json.loads(c.getresponse().read())
    finally:
        c.close()


def worker_stats(addr):
    """Every worker's (name, role, live stats) from `/debug/workers`, by name."""
    ws = get_json(addr, "/debug/workers")["workers"]
    return sorted((w["name"], w["role"], w["stats"]) for w in ws)


def colocated(decode_lines):
    """A cluster.toml of one colocated decode worker on loopback ports the OS picks, with
    `decode_lines` added to its [decode] section."""
    return ('[router]\nlisten = "127.0.0.1:0"\ncontrol = "127.0.0.1:0"\n'
            "[decode]\nreplicas = 1\nthreads = 1\n" + decode_lines)


def pct(xs, p):
    """The `p`-th percentile of `xs` (nearest rank)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]
