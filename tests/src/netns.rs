//! Network namespaces for multi-host tests (root only): a command runner, and a LAN of
//! namespaces on one bridge (the bridge in a namespace of its own, so that no firewall of this
//! machine's sees the traffic), reachable from the test's own namespace.

use std::process::{Child, Command, Stdio};

/// Runs a command; its stderr as the error when it fails.
pub fn sh(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{args:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// Hosts `10.<net>.0.1`, `.2`, … (one namespace each) and this namespace at `10.<net>.0.254`,
/// all on one bridge. Everything is deleted when it drops.
pub struct Lan {
    switch: String,
    hosts: Vec<String>,
    uplink: String,
    net: u8,
}

impl Lan {
    /// `n` hosts on subnet `10.<net>.0.0/24`.
    pub fn new(net: u8, n: usize) -> Result<Lan, String> {
        let id = std::process::id() % 10000;
        let switch = format!("tds{net}x{id}");
        let mut lan = Lan {
            switch: switch.clone(),
            hosts: Vec::new(),
            uplink: format!("tdu{net}x{id}"),
            net,
        };
        let br = "br0";
        sh(&["ip", "netns", "add", &switch])?;
        sh(&["ip", "-n", &switch, "link", "add", br, "type", "bridge"])?;
        sh(&["ip", "-n", &switch, "link", "set", br, "up"])?;
        // This namespace's own port on the LAN.
        let (up, up_peer) = (lan.uplink.clone(), format!("tdv{net}x{id}"));
        sh(&[
            "ip", "link", "add", &up, "type", "veth", "peer", "name", &up_peer,
        ])?;
        sh(&["ip", "link", "set", &up_peer, "netns", &switch])?;
        sh(&[
            "ip", "-n", &switch, "link", "set", &up_peer, "master", br, "up",
        ])?;
        sh(&[
            "ip",
            "addr",
            "add",
            &format!("10.{net}.0.254/24"),
            "dev",
            &up,
        ])?;
        sh(&["ip", "link", "set", &up, "up"])?;
        for h in 1..=n {
            let ns = format!("tdh{net}x{id}x{h}");
            let (inside, port) = (format!("eth{h}"), format!("tdp{net}x{id}x{h}"));
            sh(&["ip", "netns", "add", &ns])?;
            lan.hosts.push(ns.clone());
            sh(&[
                "ip", "link", "add", &port, "type", "veth", "peer", "name", &inside,
            ])?;
            sh(&["ip", "link", "set", &inside, "netns", &ns])?;
            sh(&["ip", "link", "set", &port, "netns", &switch])?;
            sh(&[
                "ip", "-n", &switch, "link", "set", &port, "master", br, "up",
            ])?;
            sh(&[
                "ip",
                "-n",
                &ns,
                "addr",
                "add",
                &format!("10.{net}.0.{h}/24"),
                "dev",
                &inside,
            ])?;
            sh(&["ip", "-n", &ns, "link", "set", &inside, "up"])?;
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(lan)
    }

    /// Host `h`'s address (1-based).
    pub fn ip(&self, h: usize) -> String {
        format!("10.{}.0.{h}", self.net)
    }

    /// Host `h`'s namespace.
    pub fn netns(&self, h: usize) -> &str {
        &self.hosts[h - 1]
    }

    /// Starts `program args` in host `h`'s namespace, stderr piped.
    pub fn spawn(&self, h: usize, program: &str, args: &[&str]) -> Child {
        Command::new("ip")
            .args(["netns", "exec", &self.hosts[h - 1], program])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start a process in a namespace")
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        let _ = sh(&["ip", "link", "del", &self.uplink]);
        for ns in self.hosts.iter().chain([&self.switch]) {
            let _ = sh(&["ip", "netns", "del", ns]);
        }
    }
}
