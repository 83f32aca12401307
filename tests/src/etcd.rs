//! A real etcd for tests (Debian's `etcd-server`), on loopback ports picked free, with its data
//! in a scratch directory so that a killed one restarts with what it had; its members read
//! through its HTTP gateway.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::cluster::{get, post_json};

/// One etcd process (killed when dropped).
pub struct Etcd {
    child: Option<Child>,
    /// The network namespace it runs in (`None`: this one).
    netns: Option<String>,
    dir: PathBuf,
    /// Its client address.
    pub client: SocketAddr,
    peer: SocketAddr,
    /// Under TLS: the cluster's certificate directory (etcd serves `etcd.crt` from it and
    /// requires clients' certificates from its CA), and the plain address of its health check.
    tls: Option<(PathBuf, SocketAddr)>,
}

/// Whether an `etcd` binary is installed; outside CI a test may skip without one.
pub fn available() -> bool {
    let found = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found || std::env::var_os("CI").is_none(),
        "etcd is not installed (apt install etcd-server; scripts/test.sh does)"
    );
    found
}

/// A fresh scratch directory for one etcd's data.
fn data_dir() -> PathBuf {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    std::env::temp_dir().join(format!("tandem-etcd-{}-{n}", std::process::id()))
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
}

impl Etcd {
    /// Starts etcd and waits until it answers its health check.
    pub fn start() -> Etcd {
        Etcd::start_at(None, free_port(), free_port())
    }

    /// Starts etcd in network namespace `netns`, on `ip`'s ports 2379 and 2380.
    pub fn start_in(netns: &str, ip: &str) -> Etcd {
        let at = |port| format!("{ip}:{port}").parse().expect("an IP address");
        Etcd::start_at(Some(netns.into()), at(2379), at(2380))
    }

    fn start_at(netns: Option<String>, client: SocketAddr, peer: SocketAddr) -> Etcd {
        let mut e = Etcd {
            child: None,
            netns,
            dir: data_dir(),
            client,
            peer,
            tls: None,
        };
        e.restart();
        e
    }

    /// Starts etcd with mutual TLS under the cluster CA in `pki` (made there if missing): it
    /// serves a certificate for `etcd.tandem` and accepts only clients with the CA's.
    pub fn start_tls(pki: &std::path::Path) -> Etcd {
        let store = pki::Store::at(pki);
        store.init().expect("a cluster CA");
        store.export(pki::Role::Etcd).expect("etcd's certificate");
        let mut e = Etcd {
            child: None,
            netns: None,
            dir: data_dir(),
            client: free_port(),
            peer: free_port(),
            tls: Some((pki.to_path_buf(), free_port())),
        };
        e.restart();
        e
    }

    /// The endpoint members are configured with.
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.client)
    }

    /// Kills etcd with SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts etcd (again) on the same ports and data; returns once it is healthy.
    pub fn restart(&mut self) {
        self.kill();
        let (c, p) = (self.endpoint(), format!("http://{}", self.peer));
        let mut cmd = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns, "etcd"]);
                c
            }
            None => Command::new("etcd"),
        };
        let child = cmd
            .args(["--name", "t", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
            .args([
                "--listen-peer-urls",
                &p,
                "--initial-advertise-peer-urls",
                &p,
            ])
            .args(["--initial-cluster", &format!("t={p}")])
            .args(self.tls_args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        self.child = Some(child);
        let t0 = Instant::now();
        let health = self.tls.as_ref().map_or(self.client, |t| t.1);
        while !get(health, "/health").is_ok_and(|(s, b)| s == 200 && b.contains("true")) {
            assert!(t0.elapsed() < Duration::from_secs(30), "etcd did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn tls_args(&self) -> Vec<String> {
        let Some((pki, metrics)) = &self.tls else {
            return Vec::new();
        };
        let f = |name: &str| pki.join(name).to_string_lossy().to_string();
        vec![
            "--cert-file".into(),
            f("etcd.crt"),
            "--key-file".into(),
            f("etcd.key"),
            "--trusted-ca-file".into(),
            f("ca.crt"),
            "--client-cert-auth".into(),
            "--listen-metrics-urls".into(),
            format!("http://{metrics}"),
        ]
    }

    /// Deletes the keys under `prefix` (their leases stay: a member that keeps its lease
    /// alive does not know).
    pub fn delete(&self, prefix: &str) {
        let (status, v) = post_json(self.client, "/v3/kv/deleterange", &range(prefix));
        assert_eq!(status, 200, "etcd deleterange: {v}");
    }

    /// The keys under `prefix` with their leases.
    pub fn leases(&self, prefix: &str) -> Vec<(String, String)> {
        let (status, v) = post_json(self.client, "/v3/kv/range", &range(prefix));
        assert_eq!(status, 200, "etcd range: {v}");
        let kvs = v["kvs"].as_array().cloned().unwrap_or_default();
        kvs.iter()
            .map(|kv: &Value| {
                let s = |k: &str| kv[k].as_str().unwrap_or_default().to_string();
                (s("key"), s("lease"))
            })
            .collect()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The request body naming every key under `prefix`.
fn range(prefix: &str) -> Value {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().expect("a non-empty prefix") += 1;
    json!({"key": base64(prefix.as_bytes()), "range_end": base64(&end)})
}

fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = c
            .iter()
            .enumerate()
            .fold(0u32, |a, (i, b)| a | (*b as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_is_the_standard_one() {
        assert_eq!(super::base64(b"/tandem/a"), "L3RhbmRlbS9h");
        assert_eq!(super::base64(b"ab"), "YWI=");
        assert_eq!(super::base64(b"a"), "YQ==");
    }
}
