//! The cluster's certificates on disk, in one directory:
//!
//! - `ca.crt`: the cluster CA every process trusts (and nothing else);
//! - `ca.key`: the CA's key, where processes may issue their own certificates (`tandem up`
//!   on one machine: each process gets a fresh certificate at start, none written to disk);
//! - `<role>.crt`, `<role>.key`: a role's certificate made ahead (`tandem pki issue`), for a
//!   deployment whose pods carry only their role's certificate and the CA (Kubernetes
//!   Secrets), never the CA key.
//!
//! Keys are written mode 0600. A directory with nothing in it gets a new CA at the first start,
//! made in a directory of its own and renamed into place, so processes starting at once agree
//! on one CA.

use std::io::Write;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SerialNumber,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::{Credentials, PkiError, Role};

/// How long a certificate made here is valid.
const CERT_DAYS: i64 = 365;
/// How long the cluster CA is valid.
const CA_DAYS: i64 = 3650;

/// The directory of a cluster's certificates.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
}

impl Store {
    /// The store at `dir` (nothing is read yet).
    pub fn at(dir: impl Into<PathBuf>) -> Store {
        Store { dir: dir.into() }
    }

    /// Its directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// This process's credentials for `role` (`name` goes in its certificate's common name):
    /// issued now where the CA key is here; else the role's certificate made ahead; else, in
    /// an empty or missing directory, a new cluster CA is made first.
    pub fn credentials(&self, role: Role, name: &str) -> Result<Credentials, PkiError> {
        if self.file("ca.key").exists() {
            return self.issue(role, name);
        }
        if self.file(&format!("{}.crt", role.name())).exists() {
            return self.load_role(role);
        }
        let has_files = std::fs::read_dir(&self.dir).is_ok_and(|mut d| d.next().is_some());
        // Another process may have renamed a new CA into place since the first look.
        if has_files && self.file("ca.key").exists() {
            return self.issue(role, name);
        }
        if has_files {
            return Err(PkiError::Invalid(format!(
                "{}: no ca.key and no {role}.crt: this directory holds no credentials for a \
                 {role} (make them with `tandem pki init` and `tandem pki issue`)",
                self.dir.display()
            )));
        }
        self.init()?;
        self.issue(role, name)
    }

    /// Makes a new cluster CA here unless one is here already (whoever renames first wins;
    /// the others use it).
    pub fn init(&self) -> Result<(), PkiError> {
        if self.file("ca.crt").exists() {
            return Ok(());
        }
        let parent = self.dir.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
        let tmp = parent.join(format!(
            ".{}.{}-{:x}",
            self.dir
                .file_name()
                .map_or("pki".into(), |n| n.to_string_lossy()),
            std::process::id(),
            random_u64()
        ));
        std::fs::create_dir(&tmp).map_err(|e| io(&tmp, e))?;
        let key = KeyPair::generate().map_err(invalid)?;
        let cert = ca_params(true).self_signed(&key).map_err(invalid)?;
        write(&tmp.join("ca.crt"), cert.pem().as_bytes(), false)?;
        write(&tmp.join("ca.key"), key.serialize_pem().as_bytes(), true)?;
        if std::fs::rename(&tmp, &self.dir).is_err() {
            // Another process made it first (or the directory is not empty): use theirs.
            let _ = std::fs::remove_dir_all(&tmp);
            if !self.file("ca.crt").exists() {
                return Err(PkiError::Invalid(format!(
                    "{}: could not create the cluster CA here",
                    self.dir.display()
                )));
            }
        }
        Ok(())
    }

    /// A fresh certificate for `role`, signed by the CA key here (kept in memory).
    pub fn issue(&self, role: Role, name: &str) -> Result<Credentials, PkiError> {
        let ca_key = KeyPair::from_pem(&read(&self.file("ca.key"))?).map_err(invalid)?;
        let ca_pem = read(&self.file("ca.crt"))?;
        let issuer = Issuer::new(ca_params(false), ca_key);
        let key = KeyPair::generate().map_err(invalid)?;
        let cert = leaf_params(role, name)?
            .signed_by(&key, &issuer)
            .map_err(invalid)?;
        Credentials::from_pems(role, cert.pem(), key.serialize_pem(), ca_pem)
    }

    /// Writes a certificate for `role` here (`<role>.crt`, `<role>.key`), for a deployment.
    pub fn export(&self, role: Role) -> Result<(PathBuf, PathBuf), PkiError> {
        let c = self.issue(role, &format!("{role} (deployment)"))?;
        let (cert, key, _) = c.pems();
        let (crt_at, key_at) = (
            self.file(&format!("{role}.crt")),
            self.file(&format!("{role}.key")),
        );
        write(&crt_at, cert.as_bytes(), false)?;
        write(&key_at, key.as_bytes(), true)?;
        Ok((crt_at, key_at))
    }

    fn load_role(&self, role: Role) -> Result<Credentials, PkiError> {
        let cert = read(&self.file(&format!("{role}.crt")))?;
        let key = read(&self.file(&format!("{role}.key")))?;
        let ca = read(&self.file("ca.crt"))?;
        let c = Credentials::from_pems(role, cert, key, ca)?;
        if Role::of(c.cert()) != Some(role) {
            return Err(PkiError::Invalid(format!(
                "{}: {role}.crt does not name the role {role}",
                self.dir.display()
            )));
        }
        Ok(c)
    }
}

impl Credentials {
    /// Credentials from PEM text: a certificate naming `role`, its key, the CA.
    pub fn from_pems(
        role: Role,
        cert_pem: String,
        key_pem: String,
        ca_pem: String,
    ) -> Result<Credentials, PkiError> {
        fn bad(what: &'static str) -> impl Fn(rustls::pki_types::pem::Error) -> PkiError {
            move |e| PkiError::Invalid(format!("{what}: {e}"))
        }
        let cert =
            CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(bad("certificate"))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(bad("key"))?;
        let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(bad("CA"))?;
        Ok(Credentials {
            role,
            cert,
            key,
            ca,
            cert_pem,
            key_pem,
            ca_pem,
        })
    }
}

/// The CA's parameters: the same every time, so an issuer rebuilt from the key signs
/// certificates that chain to the CA certificate written at `init` (`fresh`: with a validity
/// from now, for that certificate).
fn ca_params(fresh: bool) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "tandem");
    dn.push(DnType::CommonName, "tandem cluster CA");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    if fresh {
        let now = time::OffsetDateTime::now_utc();
        p.not_before = now - time::Duration::days(1);
        p.not_after = now + time::Duration::days(CA_DAYS);
        p.serial_number = Some(SerialNumber::from_slice(&random_u64().to_be_bytes()));
    }
    p
}

/// A process's certificate: its role's name (and a worker's shared one) as DNS names, for
/// both ends of TLS.
fn leaf_params(role: Role, name: &str) -> Result<CertificateParams, PkiError> {
    let mut names = vec![role.dns().to_string()];
    if matches!(role, Role::Prefill | Role::Decode) {
        names.push(Role::WORKER_DNS.to_string());
    }
    let mut p = CertificateParams::new(names).map_err(invalid)?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "tandem");
    dn.push(DnType::CommonName, format!("{role} {name}"));
    p.distinguished_name = dn;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    p.use_authority_key_identifier_extension = true;
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now - time::Duration::hours(1);
    p.not_after = now + time::Duration::days(CERT_DAYS);
    p.serial_number = Some(SerialNumber::from_slice(&random_u64().to_be_bytes()));
    Ok(p)
}

/// A random 64-bit number from the system's generator.
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b)
        .expect("the system's random generator works");
    u64::from_le_bytes(b)
}

fn invalid(e: rcgen::Error) -> PkiError {
    PkiError::Invalid(e.to_string())
}

fn io(path: &Path, error: std::io::Error) -> PkiError {
    PkiError::Io {
        path: path.display().to_string(),
        error,
    }
}

fn read(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|e| io(path, e))
}

fn write(path: &Path, bytes: &[u8], secret: bool) -> Result<(), PkiError> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create(true).truncate(true);
    if secret {
        o.mode(0o600);
    }
    let mut f = o.open(path).map_err(|e| io(path, e))?;
    f.write_all(bytes).map_err(|e| io(path, e))
}
