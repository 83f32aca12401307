//! A `tandem store` node for a test: started on a loopback port, killed when dropped.

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `tandem store`.
pub struct StoreNode {
    child: Child,
    /// Its `/metrics` endpoint.
    pub metrics: SocketAddr,
    /// How it was started: the binary, the cluster file, the environment, its address.
    started: (PathBuf, PathBuf, Vec<(String, String)>, String),
}

impl StoreNode {
    /// Starts `exe store` with the cluster file `config`; returns it and its gRPC address
    /// (`http://HOST:PORT`), read from its lines on stderr within 60 s.
    pub fn start(exe: &Path, config: &Path) -> (StoreNode, String) {
        StoreNode::start_with(exe, config, &[])
    }

    /// [`StoreNode::start`] with more environment (`env`: the fault-injection variables of
    /// `tandem store`, such as `TANDEM_FAULT_STORE_CORRUPT_GETS`).
    pub fn start_with(exe: &Path, config: &Path, env: &[(&str, &str)]) -> (StoreNode, String) {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        StoreNode::start_at(exe, config, &env, "127.0.0.1:0")
    }

    /// Kills the node and starts it again on the same address, empty (a node restarted: the
    /// same name, so the same share of the blocks is placed on it).
    pub fn restart(&mut self) {
        self.kill();
        let (exe, config, env, at) = self.started.clone();
        let listen = at.trim_start_matches("http://");
        *self = StoreNode::start_at(&exe, &config, &env, listen).0;
    }

    fn start_at(
        exe: &Path,
        config: &Path,
        env: &[(String, String)],
        listen: &str,
    ) -> (StoreNode, String) {
        let mut child = Command::new(exe)
            .envs(env.iter().cloned())
            .args(["store", "--config"])
            .arg(config)
            .args(["--listen", listen])
            .stderr(Stdio::piped())
            .spawn()
            .expect("tandem store starts");
        let stderr = child.stderr.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                let after = |what: &str| line.split(what).nth(1).map(str::to_string);
                if let Some(m) = after("metrics on http://") {
                    let _ = tx.send((1, m.trim_end_matches("/metrics").to_string()));
                } else if let Some(at) = after("serving on ") {
                    let at = at.split(' ').next().unwrap_or_default().to_string();
                    let _ = tx.send((0, at));
                }
            }
        });
        let mut lines: [Option<String>; 2] = [None, None];
        while lines.iter().any(Option::is_none) {
            let (which, text) = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("the store's lines within 60 s");
            lines[which] = Some(text);
        }
        let [at, metrics] = lines.map(Option::unwrap);
        let metrics = metrics.parse().expect("the metrics address");
        let started = (exe.into(), config.into(), env.to_vec(), at.clone());
        (
            StoreNode {
                child,
                metrics,
                started,
            },
            at,
        )
    }
}

impl StoreNode {
    /// Sends `signal` (e.g. `libc::SIGSTOP`: the node frozen) to the node.
    pub fn signal(&self, signal: i32) {
        // SAFETY: signalling a child process of this test, not yet reaped (reaped on drop).
        let r = unsafe { libc::kill(self.child.id() as i32, signal) };
        assert_eq!(r, 0, "signal {signal} sent to the store node");
    }

    /// Kills the node (`kill -9`) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for StoreNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
