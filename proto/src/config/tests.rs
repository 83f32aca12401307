//! Tests of `cluster.toml` parsing and validation: every error names the file, the line and the key.

use super::*;

fn parse(src: &str) -> Result<ClusterConfig, ConfigError> {
    ClusterConfig::parse(Path::new("cluster.toml"), src)
}

#[test]
fn the_kubernetes_manifests_cluster_toml_is_valid() {
    let yaml = include_str!("../../../deploy/kubernetes/configmap.yaml");
    let toml: String = yaml
        .split_once("cluster.toml: |\n")
        .expect("the ConfigMap holds cluster.toml")
        .1
        .lines()
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect();
    let c = parse(&toml).unwrap();
    let a = c.decode.autoscale.as_ref().unwrap();
    assert_eq!(*a.actuator.get_ref(), Actuator::Kubernetes);
    assert_eq!(a.deployment.as_ref().unwrap().get_ref(), "tandem-decode");
    assert!(c.discovery.is_some());
    let e = parse("[decode]\n[decode.slo]\nitl_p90_ms = 100\n[decode.autoscale]\nmax = 2\nactuator = \"kubernetes\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "decode.autoscale.deployment: actuator = \"kubernetes\" needs the pool's deployment"
        ),
        "{e}"
    );
}

#[test]
fn discovery_names_etcd_and_checks_its_prefix_and_lease() {
    parse("[decode]\n[discovery]\netcd = [\"https://10.0.0.5:2379\"]\n").unwrap();
    let c = parse("[decode]\n[discovery]\netcd = [\"http://10.0.0.5:2379\"]\n").unwrap();
    let d = c.discovery.unwrap();
    assert_eq!(d.etcd.get_ref(), &["http://10.0.0.5:2379"]);
    assert_eq!(
        (d.prefix.get_ref().as_str(), *d.lease_ttl_ms.get_ref()),
        ("/tandem/default", 3000)
    );
    for (body, want) in [
        (
            "etcd = [\"10.0.0.5:2379\"]",
            "cluster.toml:3: discovery.etcd: must list etcd's client endpoints as https://host:port",
        ),
        ("etcd = []", "cluster.toml:3: discovery.etcd:"),
        (
            "etcd = [\"http://e:2379\"]\nprefix = \"tandem/\"",
            "cluster.toml:4: discovery.prefix: must start with / and not end with one",
        ),
        (
            "etcd = [\"http://e:2379\"]\nlease_ttl_ms = 500",
            "cluster.toml:4: discovery.lease_ttl_ms: must be at least 2000",
        ),
        ("etcd = [\"http://e:2379\"]\nttl = 5", "cluster.toml:4"),
    ] {
        let e = parse(&format!("[decode]\n[discovery]\n{body}\n"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(want), "{body}: {e}");
    }
}

#[test]
fn other_models_are_named_with_their_addresses_or_files() {
    let c = parse("[router]\nmodels = { \"m\" = \"127.0.0.1:9000\" }\n[decode]\n[[models]]\nconfig = \"b.toml\"\n").unwrap();
    assert_eq!(c.router.models["m"].get_ref(), "127.0.0.1:9000");
    assert_eq!(c.models[0].config.get_ref(), Path::new("b.toml"));
    let e = parse("[router]\nmodels = { \"m\" = \"nowhere\" }\n[decode]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cluster.toml:2: router.models.m: \"nowhere\" is not a host:port"),
        "{e}"
    );
    let e = parse("[decode]\n[[models]]\npath = \"x\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("cluster.toml:3:"), "{e}");
}

#[test]
fn fault_and_http_limits_are_checked_with_file_line_and_key() {
    let c = parse("[decode]\n").unwrap();
    assert_eq!(*c.router.heartbeat_timeout_ms.get_ref(), 2000);
    assert_eq!(*c.kv_transfer.lease_ms.get_ref(), 3000);
    let e = parse("[router]\nheartbeat_timeout_ms = 300\n[decode]\n")
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "cluster.toml:2: router.heartbeat_timeout_ms: must be at least 1000 (workers heartbeat every 250 ms)"
    );
    let e = parse("[kv_transfer]\nlease_ms = 500\n[decode]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cluster.toml:2: kv_transfer.lease_ms: must be at least 2000"),
        "{e}"
    );
    let e = parse("[router]\n\napi_keys_file = \"/nonexistent/keys\"\n[decode]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cluster.toml:3: router.api_keys_file: cannot read /nonexistent/keys"),
        "{e}"
    );
    let e = parse("[router]\nmax_body_bytes = 10\n[decode]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cluster.toml:2: router.max_body_bytes: must be at least 1024"),
        "{e}"
    );
}

#[test]
fn defaults_and_errors_name_file_line_and_key() {
    let c = parse("[decode]\n").unwrap();
    assert!(!c.disaggregated());
    assert_eq!(*c.decode.kv_blocks.get_ref(), 1024);
    let e = parse("[prefill]\nreplicas = 1\n\n[decode]\nthreads = 0\n")
        .unwrap_err()
        .to_string();
    assert_eq!(e, "cluster.toml:5: decode.threads: must be at least 1");
    let e = parse("[decode]\nreplica = 2\n").unwrap_err().to_string();
    assert!(
        e.starts_with("cluster.toml:2: decode.replica: unknown field `replica`"),
        "{e}"
    );
    let e = parse("[router]\nlisten = \"nowhere\"\n[decode]\n")
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "cluster.toml:2: router.listen: \"nowhere\" is not a host:port socket address"
    );
    let e = parse("[decode]\nkv_blocks = \"many\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cluster.toml:2: decode.kv_blocks: invalid type"),
        "{e}"
    );
    let e = parse("[kv_transfer]\nprefer = [\"quic\", \"pigeon\"]\n[decode]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cluster.toml:2: kv_transfer.prefer: unknown transport \"pigeon\""),
        "{e}"
    );
    let e = parse("").unwrap_err().to_string();
    assert!(e.contains("missing field `decode`"), "{e}");
    let e = parse("[decode]\nengine = \"gpu9\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cluster.toml:2: decode.engine: \"gpu9\" is not an engine"),
        "{e}"
    );
    let e = parse("[decode]\n[decode.autoscale]\nmin = 3\nmax = 2\n")
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "cluster.toml:4: decode.autoscale.max: must be at least min (3)"
    );
    let e = parse("[decode]\n[decode.autoscale]\nmax = 2\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("decode.autoscale.max: autoscaling needs a target: set decode.slo.itl_p90_ms"),
        "{e}"
    );
    let e = parse("[decode]\nengine = \"mock\"\n[decode.mock]\npreset = \"tpu\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cluster.toml:4: decode.mock.preset: unknown preset"),
        "{e}"
    );
    let c = parse(
        "[decode]\nengine = \"mock\"\n[decode.slo]\nitl_p90_ms = 50\n[decode.autoscale]\nmax = 4\n",
    )
    .unwrap();
    assert_eq!(*c.decode.autoscale.unwrap().max.get_ref(), 4);
    let e = parse("[decode]\n[prefill]\n[prefill.slo]\nadmission_p90_ms = 500\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("cluster.toml:4: prefill.slo.admission_p90_ms: a decode pool's target"),
        "{e}"
    );
}

#[test]
fn speculation_is_checked_with_file_line_and_key() {
    let c = parse("[decode]\nspeculation = 8\n").unwrap();
    assert_eq!(*c.decode.speculation.get_ref(), 8);
    assert_eq!(
        *parse("[decode]\n").unwrap().decode.speculation.get_ref(),
        0
    );
    let e = parse("[decode]\nspeculation = 17\n")
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "cluster.toml:2: decode.speculation: at most 16 drafts a step"
    );
    let e = parse("[prefill]\nspeculation = 4\n[decode]\n")
        .unwrap_err()
        .to_string();
    let want = "cluster.toml:2: prefill.speculation: speculation runs on decode workers";
    assert!(e.starts_with(want), "{e}");
    let e = parse("[decode]\ndevice = \"cuda:0\"\nspeculation = 4\n")
        .unwrap_err()
        .to_string();
    let want = "cluster.toml:3: decode.speculation: speculation needs batch-invariant kernels";
    assert!(e.starts_with(want), "{e}");
}

#[test]
fn an_api_open_to_other_machines_needs_keys_or_says_so() {
    let e = parse("[router]\nlisten = \"0.0.0.0:8000\"\n[decode]\n")
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("cluster.toml:2: router.listen: "), "{e}");
    assert!(e.contains("allow_no_keys"), "{e}");
    parse("[router]\nlisten = \"0.0.0.0:8000\"\nallow_no_keys = true\n[decode]\n").unwrap();
    parse("[router]\nlisten = \"127.0.0.1:8000\"\n[decode]\n").unwrap();
    let c = parse("[decode]\n[security]\ninsecure = true\ndir = \"pki\"\n").unwrap();
    assert!(c.security.insecure);
    assert_eq!(
        c.pki_dir(Path::new("/etc/tandem/cluster.toml")),
        Path::new("/etc/tandem/pki")
    );
    let d = parse("[decode]\n")
        .unwrap()
        .pki_dir(Path::new("/srv/cluster.toml"));
    assert_eq!(d, Path::new("/srv/.tandem/pki"));
}

#[test]
fn peer_fetch_needs_a_host_tier_on_the_prefill_side() {
    let on = "[kv_transfer]\npeer_fetch = true\n";
    let e = parse(&format!("[prefill]\n[decode]\n{on}"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cluster.toml:4: kv_transfer.peer_fetch: the prefill workers stage"),
        "{e}"
    );
    let staged = format!("[prefill]\n[prefill.kv_tiers]\nhost_bytes = 1000000\n[decode]\n{on}");
    assert!(*parse(&staged).unwrap().kv_transfer.peer_fetch.get_ref());
    // Off by default; colocated (no prefill pool) nothing to stage.
    assert!(!*parse("[decode]\n")
        .unwrap()
        .kv_transfer
        .peer_fetch
        .get_ref());
    assert!(parse(&format!("[decode]\n{on}")).is_ok());
}

#[test]
fn kv_tiers_and_tier_weights_are_checked_with_their_line() {
    let c = parse(
        "[decode]\n[decode.kv_tiers]\nhost_bytes = 1000000\ndisk_path = \"g3\"\ndisk_bytes = 9000000\nwrite_policy = \"hit-twice\"\n",
    )
    .unwrap();
    let t = c.decode.kv_tiers.as_ref().unwrap();
    assert_eq!(
        (t.host_bytes, *t.write_policy.as_ref().unwrap().get_ref()),
        (1_000_000, WritePolicy::HitTwice)
    );
    for (body, want) in [
        (
            "[decode]\n[decode.kv_tiers]\ndisk_path = \"g3\"\n",
            "cluster.toml:3: decode.kv_tiers.disk_bytes: a disk tier needs disk_bytes too",
        ),
        (
            "[decode]\n[decode.kv_tiers]\ndisk_bytes = 5\n",
            "cluster.toml:3: decode.kv_tiers.disk_path: disk_bytes needs a disk_path",
        ),
        (
            "[decode]\n[decode.kv_tiers]\nhost_bytes = 1000000\nwrite_policy = \"sometimes\"\n",
            "cluster.toml:4",
        ),
        (
            "[router]\ntier_weights = [0.5, 1.5]\n[decode]\n",
            "cluster.toml:2: router.tier_weights: 2 weights: give host memory's and disk's, and optionally the store's, each within 0 and 1",
        ),
        (
            "[router]\ntier_weights = [0.5]\n[decode]\n",
            "cluster.toml:2: router.tier_weights: 1 weights",
        ),
    ] {
        let e = parse(body).unwrap_err().to_string();
        assert!(e.contains(want), "{body}: {e}");
    }
}

#[test]
fn admission_is_reserve_unless_set_and_checked_with_its_line() {
    let c = parse("[decode]\nadmission = \"optimistic\"\n[prefill]\n").unwrap();
    let got = c.decode.admission.as_ref().map(|a| *a.get_ref());
    assert_eq!(got, Some(Admission::Optimistic));
    let prefill = c.prefill.as_ref().unwrap();
    assert!(prefill.admission.is_none(), "unset: the default");
    let e = parse("[decode]\nmax_running = 8\nadmission = \"greedy\"\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("cluster.toml:3") && e.contains("\"greedy\" is not an admission"),
        "{e}"
    );
}

#[test]
fn the_store_section_has_defaults_and_is_checked_with_its_line() {
    let c = parse("[decode]\n").unwrap();
    assert_eq!(*c.store.capacity_bytes.get_ref(), 4 << 30);
    let c = parse("[decode]\n[store]\nlisten = \"10.0.0.2:7400\"\ncapacity_bytes = 1000000000\n")
        .unwrap();
    assert_eq!(c.store.listen.get_ref(), "10.0.0.2:7400");
    let two = "[decode]\n[decode.kv_tiers]\nhost_bytes = 1000000\n[store]\nnodes = [\"http://a:1\", \"http://b:2\"]\n";
    let c = parse(two).unwrap();
    assert_eq!(c.store.node_uris(), ["http://a:1", "http://b:2"]);
    assert_eq!(*c.store.replicas.get_ref(), 2);
    assert!(!c.embedded_store(), "nodes named: none embedded");
    let found = "[discovery]\netcd = [\"http://e:2379\"]\n[decode]\n[decode.kv_tiers]\nhost_bytes = 1000000\n[store]\ndiscover = true\nadvertise = \"http://store-0:7400\"\n";
    let c = parse(found).unwrap();
    assert!(c.store.node_uris().is_empty() && *c.store.discover.get_ref());
    assert!(
        !c.embedded_store(),
        "nodes found through etcd: none embedded"
    );
    for (body, want) in [
        (
            "[decode]\n[store]\ncapacity_bytes = 1000\n",
            "cluster.toml:3: store.capacity_bytes: must hold at least two",
        ),
        (
            "[decode]\n[store]\nlisten = \"store:7400\"\n",
            "cluster.toml:3: store.listen:",
        ),
        (
            "[decode]\n[store]\nlease_ms = 0\n",
            "cluster.toml:3: store.lease_ms",
        ),
        (
            "[decode]\n[store]\nreplicas = 0\n",
            "cluster.toml:3: store.replicas",
        ),
        ("[decode]\n[store]\nshards = 2\n", "cluster.toml:3"),
        (
            "[decode]\n[store]\nnode = \"http://a:1\"\nnodes = [\"http://b:1\"]\n",
            "cluster.toml:4: store.nodes: set store.node (one) or store.nodes (several), not both",
        ),
        (
            "[decode]\n[store]\nnodes = [\"http://b:1\", \"http://b:1\"]\n",
            "cluster.toml:3: store.nodes: \"http://b:1\" is named twice",
        ),
        (
            "[decode]\n[store]\nnodes = []\n",
            "store.nodes: names no node",
        ),
        (
            "[decode]\n[store]\nnodes = [\"http://b:1\", \"b:2\"]\n",
            "cluster.toml:3: store.nodes: \"b:2\" is not http://HOST:PORT",
        ),
        (
            "[decode]\n[store]\nnodes = [\"http://b:1\"]\n",
            "store.nodes: the decode workers stage blocks fetched from the store in host memory",
        ),
        (
            "[decode]\n[decode.kv_tiers]\nhost_bytes = 1000000\n[store]\ndiscover = true\n",
            "cluster.toml:5: store.discover: store nodes are found through etcd: set [discovery]",
        ),
        (
            "[discovery]\netcd = [\"http://e:2379\"]\n[decode]\n[store]\ndiscover = true\n",
            "cluster.toml:5: store.discover: the decode workers stage blocks fetched from the store",
        ),
        (
            "[decode]\n[store]\nadvertise = \"store-0:7400\"\n",
            "cluster.toml:3: store.advertise: \"store-0:7400\" is not http://HOST:PORT",
        ),
    ] {
        let e = parse(body).unwrap_err().to_string();
        assert!(e.contains(want), "{body}: {e}");
    }
}
