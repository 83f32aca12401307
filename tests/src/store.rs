//! A `tandem store` node for a test: started on a loopback port, killed when dropped.

use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `tandem store`.
pub struct StoreNode(Child);

impl StoreNode {
    /// Starts `exe store` with the cluster file `config`; returns it and its gRPC address
    /// (`http://HOST:PORT`), read from its line on stderr within 60 s.
    pub fn start(exe: &Path, config: &Path) -> (StoreNode, String) {
        let mut child = Command::new(exe)
            .args(["store", "--config"])
            .arg(config)
            .args(["--listen", "127.0.0.1:0"])
            .stderr(Stdio::piped())
            .spawn()
            .expect("tandem store starts");
        let stderr = child.stderr.take().expect("piped");
        let node = StoreNode(child);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if let Some(at) = line.split("serving on ").nth(1) {
                    let _ = tx.send(at.to_string());
                }
            }
        });
        let at = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the store's line within 60 s");
        (node, at)
    }
}

impl Drop for StoreNode {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
