//! `cluster.toml`'s checks beyond its types: ranges, addresses, what one key needs of another.
//! Every error names the file, the line and the key.

use std::net::SocketAddr;
use std::path::Path;

use toml::Spanned;

use super::{
    Actuator, AutoscaleSection, ConfigError, DiscoverySection, KvTiersSection, KvTransferSection,
    PoolSection, RouterSection, StoreSection,
};

/// The file being checked, for errors' `file:line: key:`.
pub(super) struct Ctx<'a> {
    pub(super) file: &'a Path,
    pub(super) src: &'a str,
}

impl Ctx<'_> {
    fn line(&self, offset: usize) -> usize {
        self.src[..offset.min(self.src.len())].matches('\n').count() + 1
    }

    pub(super) fn err<T>(
        &self,
        span: std::ops::Range<usize>,
        key: &str,
        msg: impl std::fmt::Display,
    ) -> Result<T, ConfigError> {
        let at = if span.is_empty() {
            "(default)".to_string()
        } else {
            format!("{}", self.line(span.start))
        };
        Err(ConfigError(format!(
            "{}:{at}: {key}: {msg}",
            self.file.display()
        )))
    }

    /// A TOML or type error (a value of the wrong type, a name outside a choice's), with the
    /// key it is at, read from the document: the table the line is in, and the line's key.
    pub(super) fn toml(&self, e: &toml::de::Error) -> ConfigError {
        let Some(span) = e.span() else {
            return ConfigError(format!("{}: {}", self.file.display(), e.message()));
        };
        let line = self.line(span.start);
        match self.key_at(span.start) {
            Some(key) => ConfigError(format!(
                "{}:{line}: {key}: {}",
                self.file.display(),
                e.message()
            )),
            None => ConfigError(format!("{}:{line}: {}", self.file.display(), e.message())),
        }
    }

    /// The dotted key whose value is at `offset`: the last `[table]` header before it and the
    /// key before the `=` on its line.
    fn key_at(&self, offset: usize) -> Option<String> {
        let before = &self.src[..offset.min(self.src.len())];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let (key, _) = self.src[line_start..].split_once('=')?;
        let key = key.trim().trim_matches('"');
        if key.is_empty() || key.starts_with('[') {
            return None;
        }
        let table = before[..line_start].lines().rev().find_map(|l| {
            let l = l.trim();
            l.strip_prefix('[').map(|h| {
                h.trim_start_matches('[')
                    .trim_end_matches(']')
                    .trim()
                    .to_string()
            })
        });
        Some(match table {
            Some(t) if !t.is_empty() => format!("{t}.{key}"),
            _ => key.to_string(),
        })
    }

    pub(super) fn positive<T: PartialOrd + Default + Copy>(
        &self,
        v: &Spanned<T>,
        key: &str,
    ) -> Result<(), ConfigError> {
        if *v.get_ref() <= T::default() {
            return self.err(v.span(), key, "must be at least 1");
        }
        Ok(())
    }

    fn at_least(
        &self,
        v: &Spanned<u64>,
        key: &str,
        min: u64,
        why: &str,
    ) -> Result<(), ConfigError> {
        if *v.get_ref() < min {
            return self.err(v.span(), key, format!("must be at least {min} ({why})"));
        }
        Ok(())
    }

    fn addr(&self, v: &Spanned<String>, key: &str) -> Result<(), ConfigError> {
        if v.get_ref().parse::<SocketAddr>().is_err() {
            return self.err(
                v.span(),
                key,
                format!("{:?} is not a host:port socket address", v.get_ref()),
            );
        }
        Ok(())
    }

    /// `[router]`.
    pub(super) fn router(&self, r: &RouterSection) -> Result<(), ConfigError> {
        self.addr(&r.listen, "router.listen")?;
        self.addr(&r.control, "router.control")?;
        for (name, addr) in &r.models {
            self.addr(addr, &format!("router.models.{name}"))?;
        }
        let beats = "workers heartbeat every 250 ms";
        self.at_least(
            &r.heartbeat_timeout_ms,
            "router.heartbeat_timeout_ms",
            1000,
            beats,
        )?;
        self.at_least(&r.stall_timeout_ms, "router.stall_timeout_ms", 1000, beats)?;
        self.positive(&r.request_timeout_ms, "router.request_timeout_ms")?;
        let rebalance = *r.kv_rebalance.get_ref();
        if rebalance != 0.0 && !(rebalance > 1.0 && rebalance.is_finite()) {
            return self.err(
                r.kv_rebalance.span(),
                "router.kv_rebalance",
                format!("{rebalance}: 0 (off) or a ratio of the fullest worker's KV to the mean above 1"),
            );
        }
        if let Some(w) = &r.tier_weights {
            let n = w.get_ref().len();
            if !(2..=3).contains(&n) || !w.get_ref().iter().all(|x| (0.0..=1.0).contains(x)) {
                let m = format!(
                    "{n} weights: give host memory's and disk's, and optionally the store's, each \
                     within 0 and 1"
                );
                return self.err(w.span(), "router.tier_weights", &m);
            }
        }
        let fit = "a request must fit";
        self.at_least(&r.max_body_bytes, "router.max_body_bytes", 1024, fit)?;
        self.at_least(&r.max_header_bytes, "router.max_header_bytes", 1024, fit)?;
        self.positive(&r.max_connections, "router.max_connections")?;
        self.positive(
            &r.max_connections_per_address,
            "router.max_connections_per_address",
        )?;
        let loopback = r
            .listen
            .get_ref()
            .parse::<SocketAddr>()
            .is_ok_and(|a| a.ip().is_loopback());
        if !loopback && r.api_keys_file.is_none() && !r.allow_no_keys {
            let m = format!(
                "{} is reachable from other machines and there is no api_keys_file: set one, or \
                 allow_no_keys = true to serve anyone who reaches it",
                r.listen.get_ref()
            );
            return self.err(r.listen.span(), "router.listen", m);
        }
        if let Some(f) = &r.api_keys_file {
            let key = "router.api_keys_file";
            match std::fs::read_to_string(f.get_ref()) {
                Ok(t)
                    if t.lines()
                        .any(|l| !l.trim().is_empty() && !l.trim().starts_with('#')) => {}
                Ok(_) => return self.err(f.span(), key, "the file holds no key"),
                Err(e) => {
                    let m = format!("cannot read {}: {e}", f.get_ref().display());
                    return self.err(f.span(), key, m);
                }
            }
        }
        Ok(())
    }

    /// `[prefill]` or `[decode]`.
    pub(super) fn pool(&self, name: &str, pool: &PoolSection) -> Result<(), ConfigError> {
        self.positive(&pool.replicas, &format!("{name}.replicas"))?;
        self.positive(&pool.threads, &format!("{name}.threads"))?;
        self.positive(&pool.kv_blocks, &format!("{name}.kv_blocks"))?;
        self.positive(&pool.max_batch_tokens, &format!("{name}.max_batch_tokens"))?;
        self.positive(&pool.max_running, &format!("{name}.max_running"))?;
        self.positive(&pool.drain_timeout_ms, &format!("{name}.drain_timeout_ms"))?;
        let k = *pool.speculation.get_ref();
        let key = format!("{name}.speculation");
        if k > 16 {
            return self.err(pool.speculation.span(), &key, "at most 16 drafts a step");
        }
        if k > 0 && name == "prefill" {
            let why = "speculation runs on decode workers (prefill workers sample nothing)";
            return self.err(pool.speculation.span(), &key, why);
        }
        if k > 0 && pool.device.get_ref().starts_with("cuda") {
            let why = "speculation needs batch-invariant kernels; the CUDA forward's GEMMs pick \
                       their kernel by the row count, so it could change a token (CPU only)";
            return self.err(pool.speculation.span(), &key, why);
        }
        let dev = pool.device.get_ref();
        let cuda_ok = dev
            .strip_prefix("cuda:")
            .is_some_and(|n| n.parse::<u32>().is_ok());
        if dev != "cpu" && !cuda_ok {
            return self.err(
                pool.device.span(),
                &format!("{name}.device"),
                format!("{dev:?} is not a device (cpu, cuda:N)"),
            );
        }
        if let Some(t) = &pool.kv_tiers {
            self.tiers(name, pool, t)?;
        }
        if let Some(w) = pool
            .slo
            .admission_p90_ms
            .as_ref()
            .filter(|_| name == "prefill")
        {
            let m = "a decode pool's target: the prefill pool has no wait for room";
            return self.err(w.span(), "prefill.slo.admission_p90_ms", m);
        }
        match &pool.autoscale {
            Some(a) => self.autoscale(name, pool, a),
            None => Ok(()),
        }
    }

    /// `[<pool>.kv_tiers]`: a disk tier has a directory and a size; tiers need the prefix
    /// cache.
    fn tiers(&self, name: &str, pool: &PoolSection, t: &KvTiersSection) -> Result<(), ConfigError> {
        let key = |k: &str| format!("{name}.kv_tiers.{k}");
        match (&t.disk_path, &t.disk_bytes) {
            (Some(p), None) => {
                return self.err(
                    p.span(),
                    &key("disk_bytes"),
                    "a disk tier needs disk_bytes too",
                )
            }
            (None, Some(b)) => {
                return self.err(b.span(), &key("disk_path"), "disk_bytes needs a disk_path")
            }
            (Some(p), Some(_)) if p.get_ref().is_empty() => {
                return self.err(p.span(), &key("disk_path"), "an empty path")
            }
            (Some(_), Some(b)) => self.positive(b, &key("disk_bytes"))?,
            (None, None) => {}
        }
        if !pool.prefix_cache {
            let span = t.disk_path.as_ref().map_or(0..0, |p| p.span());
            let m = "KV tiers keep the prefix cache's blocks: set prefix_cache = true";
            return self.err(span, &key("host_bytes"), m);
        }
        Ok(())
    }

    /// `[<pool>.autoscale]`: bounds, a target to scale on, what the actuator needs.
    fn autoscale(
        &self,
        name: &str,
        pool: &PoolSection,
        a: &AutoscaleSection,
    ) -> Result<(), ConfigError> {
        let key = |k: &str| format!("{name}.autoscale.{k}");
        self.positive(&a.min, &key("min"))?;
        self.positive(&a.tick_ms, &key("tick_ms"))?;
        self.positive(&a.window_ms, &key("window_ms"))?;
        if a.max.get_ref() < a.min.get_ref() {
            let m = format!("must be at least min ({})", a.min.get_ref());
            return self.err(a.max.span(), &key("max"), m);
        }
        let (target, slo) = match name {
            "prefill" => (pool.slo.ttft_p90_ms, "ttft_p90_ms"),
            _ => (pool.slo.itl_p90_ms, "itl_p90_ms"),
        };
        if target.is_none() {
            let m = format!("autoscaling needs a target: set {name}.slo.{slo}");
            return self.err(a.max.span(), &key("max"), m);
        }
        match (a.actuator.get_ref(), &a.command, &a.deployment) {
            (Actuator::Command, None, _) => self.err(
                a.actuator.span(),
                &key("command"),
                "actuator = \"command\" needs a command",
            ),
            (Actuator::Kubernetes, _, None) => self.err(
                a.actuator.span(),
                &key("deployment"),
                "actuator = \"kubernetes\" needs the pool's deployment",
            ),
            _ => Ok(()),
        }
    }

    /// `[kv_transfer]`.
    pub(super) fn kv_transfer(&self, t: &KvTransferSection) -> Result<(), ConfigError> {
        if t.prefer.get_ref().is_empty() {
            let m = "must name at least one transport";
            return self.err(t.prefer.span(), "kv_transfer.prefer", m);
        }
        self.positive(&t.connect_timeout_ms, "kv_transfer.connect_timeout_ms")?;
        self.positive(&t.transfer_timeout_ms, "kv_transfer.transfer_timeout_ms")?;
        self.at_least(
            &t.lease_ms,
            "kv_transfer.lease_ms",
            2000,
            "senders renew every second",
        )
    }

    /// `[store]`.
    pub(super) fn store(&self, s: &StoreSection) -> Result<(), ConfigError> {
        self.addr(&s.listen, "store.listen")?;
        self.positive(&s.max_object_bytes, "store.max_object_bytes")?;
        let (cap, max) = (*s.capacity_bytes.get_ref(), *s.max_object_bytes.get_ref());
        if cap < max.saturating_mul(2) {
            let m = format!("must hold at least two of the largest objects ({max} bytes each)");
            return self.err(s.capacity_bytes.span(), "store.capacity_bytes", m);
        }
        self.positive(&s.lease_ms, "store.lease_ms")?;
        self.positive(&s.fetch_timeout_ms, "store.fetch_timeout_ms")?;
        if let (Some(_), Some(ns)) = (&s.node, &s.nodes) {
            let m = "set store.node (one) or store.nodes (several), not both";
            return self.err(ns.span(), "store.nodes", m);
        }
        if let Some((span, key)) = s.nodes_span() {
            let uris = s.node_uris();
            if uris.is_empty() {
                return self.err(span, key, "names no node");
            }
            for (i, uri) in uris.iter().enumerate() {
                if !http_host_port(uri) {
                    let m = format!("{uri:?} is not http://HOST:PORT");
                    return self.err(span.clone(), key, m);
                }
                if uris[..i].contains(uri) {
                    return self.err(span.clone(), key, format!("{uri:?} is named twice"));
                }
            }
        }
        if let Some(a) = &s.advertise {
            if !http_host_port(a.get_ref()) {
                let m = format!("{:?} is not http://HOST:PORT", a.get_ref());
                return self.err(a.span(), "store.advertise", m);
            }
        }
        self.positive(&s.replicas, "store.replicas")?;
        self.positive(&s.put_deadline_ms, "store.put_deadline_ms")
    }

    /// `[discovery]`.
    pub(super) fn discovery(&self, d: &DiscoverySection) -> Result<(), ConfigError> {
        let scheme = |e: &&String| e.starts_with("http://") || e.starts_with("https://");
        let bad = d.etcd.get_ref().iter().find(|e| !scheme(e));
        if d.etcd.get_ref().is_empty() || bad.is_some() {
            return self.err(
                d.etcd.span(),
                "discovery.etcd",
                "must list etcd's client endpoints as https://host:port (or http:// for an etcd \
                 without TLS)",
            );
        }
        if !d.prefix.get_ref().starts_with('/') || d.prefix.get_ref().ends_with('/') {
            return self.err(
                d.prefix.span(),
                "discovery.prefix",
                "must start with / and not end with one",
            );
        }
        self.at_least(
            &d.lease_ttl_ms,
            "discovery.lease_ttl_ms",
            2000,
            "etcd's shortest lease is 2 s",
        )
    }
}

/// Whether `uri` is `http://HOST:PORT`.
fn http_host_port(uri: &str) -> bool {
    let addr = uri.strip_prefix("http://").unwrap_or_default();
    addr.rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok())
}
