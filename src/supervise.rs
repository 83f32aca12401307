//! `tandem up`'s supervisor: once the cluster is up, a process that exits is started again —
//! at once the first time, then after a delay that doubles while it keeps failing soon after
//! starting — with one log line each time, while the others keep serving. Only Ctrl-C or
//! SIGTERM stops the cluster.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use tokio::process::Child;
use tokio::sync::mpsc;

/// A process the supervisor keeps running.
pub struct Process {
    /// Its name in log lines (`router`, `decode-1`).
    pub name: String,
    /// Its arguments, the same for every start.
    pub args: Vec<String>,
}

/// A process that ran for less than this before exiting failed "soon": its next start waits.
const SOON: Duration = Duration::from_secs(30);
/// The longest wait before a start.
const MAX_DELAY: Duration = Duration::from_secs(10);

/// How long to wait before starting a process again after its `failures`-th exit in a row
/// soon after a start: nothing the first time, then 0.5 s doubling up to [`MAX_DELAY`].
pub fn backoff(failures: u32) -> Duration {
    match failures {
        0 | 1 => Duration::ZERO,
        n => (Duration::from_millis(250) * 2u32.saturating_pow(n - 1)).min(MAX_DELAY),
    }
}

enum Event {
    /// Process `i` exited after running for the duration.
    Exited(usize, std::process::ExitStatus, Duration),
    /// Process `i`'s delay is over: start it.
    Start(usize),
}

/// Waits for `child` (process `i`) on a task of its own; its pid is returned.
fn watch(i: usize, mut child: Child, tx: &mpsc::UnboundedSender<Event>) -> Option<u32> {
    let pid = child.id();
    let tx = tx.clone();
    let started = Instant::now();
    tokio::spawn(async move {
        if let Ok(status) = child.wait().await {
            let _ = tx.send(Event::Exited(i, status, started.elapsed()));
        }
    });
    pid
}

/// Keeps `procs` (started already: `children`, in the same order) running until Ctrl-C or
/// SIGTERM, then stops them all (SIGTERM, SIGKILL after 5 s). `spawn` starts a process again.
pub async fn run(
    exe: &Path,
    procs: Vec<Process>,
    children: Vec<Child>,
    spawn: impl Fn(&Path, &[&str]) -> Result<Child>,
) -> Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut pids: Vec<Option<u32>> = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        pids.push(watch(i, c, &tx));
    }
    let mut failures = vec![0u32; procs.len()];
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("watching SIGTERM")?;
    loop {
        let event = tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = term.recv() => break,
            e = rx.recv() => e.expect("the supervisor holds a sender"),
        };
        match event {
            Event::Exited(i, status, ran) => {
                pids[i] = None;
                failures[i] = if ran < SOON { failures[i] + 1 } else { 1 };
                let delay = backoff(failures[i]);
                eprintln!(
                    "tandem: {} exited ({status}) after {:.1} s; starting it again in {:.1} s \
                     (the others keep serving)",
                    procs[i].name,
                    ran.as_secs_f64(),
                    delay.as_secs_f64()
                );
                let tx = tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let _ = tx.send(Event::Start(i));
                });
            }
            Event::Start(i) => {
                let args: Vec<&str> = procs[i].args.iter().map(String::as_str).collect();
                match spawn(exe, &args) {
                    Ok(c) => pids[i] = watch(i, c, &tx),
                    Err(e) => {
                        eprintln!("tandem: starting {} again failed: {e:#}", procs[i].name);
                        failures[i] += 1;
                        let (tx, delay) = (tx.clone(), backoff(failures[i]).max(MAX_DELAY / 10));
                        tokio::spawn(async move {
                            tokio::time::sleep(delay).await;
                            let _ = tx.send(Event::Start(i));
                        });
                    }
                }
            }
        }
    }
    eprintln!("tandem: stopping the cluster");
    stop(&procs, &mut pids, &mut rx).await;
    Ok(())
}

/// SIGTERM to every running process; SIGKILL to those still running 5 s later.
async fn stop(
    procs: &[Process],
    pids: &mut [Option<u32>],
    rx: &mut mpsc::UnboundedReceiver<Event>,
) {
    let signal = |pid: u32, sig: i32| {
        // SAFETY: signalling a child process of ours (its pid is still ours: it has not been
        // reaped, or its waiter would have cleared the entry).
        unsafe { libc::kill(pid as i32, sig) };
    };
    pids.iter()
        .flatten()
        .for_each(|&p| signal(p, libc::SIGTERM));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while pids.iter().any(Option::is_some) {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(Event::Exited(i, ..))) => pids[i] = None,
            Ok(Some(Event::Start(_))) => {}
            Ok(None) | Err(_) => break,
        }
    }
    for (i, pid) in pids.iter().enumerate() {
        if let Some(p) = *pid {
            eprintln!(
                "tandem: {} did not stop on SIGTERM; killing it",
                procs[i].name
            );
            signal(p, libc::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_failing_again_and_again_waits_longer_each_time_up_to_ten_seconds() {
        let delays: Vec<f64> = (1..=8).map(|n| backoff(n).as_secs_f64()).collect();
        assert_eq!(delays, [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]);
    }
}
