//! `tandem pki`: the cluster's certificates for a deployment. `tandem up` needs none of this
//! (it makes a CA beside cluster.toml at the first start); a deployment whose pods must not
//! hold the CA key makes the CA once and a certificate per role, then gives each pod its
//! role's (Kubernetes Secrets: see deploy/kubernetes).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

/// `tandem pki …`.
#[derive(Subcommand)]
pub enum PkiCmd {
    /// Make a new cluster CA in a directory (`ca.crt`, `ca.key`), unless it has one.
    Init(DirArgs),
    /// Write a certificate for a role (`<role>.crt`, `<role>.key`) signed by the CA there.
    Issue {
        #[command(flatten)]
        dir: DirArgs,
        /// `router`, `prefill`, `decode` or `etcd` (the certificate etcd serves with).
        #[arg(long)]
        role: String,
    },
}

/// Where the certificates are.
#[derive(Args)]
pub struct DirArgs {
    /// The certificate directory (what `[security] dir` names).
    #[arg(long)]
    dir: PathBuf,
}

/// Runs `cmd`.
pub fn run(cmd: PkiCmd) -> Result<()> {
    match cmd {
        PkiCmd::Init(d) => {
            let s = pki::Store::at(&d.dir);
            s.init()
                .with_context(|| format!("making a CA in {}", d.dir.display()))?;
            println!("cluster CA: {}", d.dir.join("ca.crt").display());
        }
        PkiCmd::Issue { dir, role } => {
            let role = pki::Role::ALL
                .into_iter()
                .find(|r| r.name() == role)
                .with_context(|| {
                    format!("--role {role:?}: one of router, prefill, decode, etcd, store")
                })?;
            let (crt, key) = pki::Store::at(&dir.dir).export(role).with_context(|| {
                format!("issuing a {role} certificate in {}", dir.dir.display())
            })?;
            println!("{role}: {} {}", crt.display(), key.display());
        }
    }
    Ok(())
}
