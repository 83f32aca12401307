use super::*;

fn temp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tandem-pki-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn a_new_store_makes_one_ca_and_certificates_that_name_their_role() {
    let dir = temp("roles");
    let s = Store::at(dir.join("pki"));
    for role in Role::ALL {
        let c = s.credentials(role, "t").unwrap();
        assert_eq!(Role::of(c.cert()), Some(role));
    }
    // The CA is made once: a second store over the directory issues under the same CA.
    let ca = std::fs::read_to_string(dir.join("pki/ca.crt")).unwrap();
    let again = Store::at(dir.join("pki"))
        .credentials(Role::Router, "u")
        .unwrap();
    assert_eq!(again.pems().2, ca);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.join("pki/ca.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "the CA key is private");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_deployment_directory_holds_role_certificates_without_the_ca_key() {
    let dir = temp("export");
    let s = Store::at(&dir);
    s.init().unwrap();
    s.export(Role::Prefill).unwrap();
    std::fs::remove_file(dir.join("ca.key")).unwrap();
    let c = s.credentials(Role::Prefill, "p").unwrap();
    assert_eq!(Role::of(c.cert()), Some(Role::Prefill));
    let e = s.credentials(Role::Decode, "d").unwrap_err().to_string();
    assert!(e.contains("no credentials for a decode"), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A handshake over an in-memory pipe: what the server's acceptor says of the client.
async fn handshake(
    server: &Credentials,
    client: Option<&Credentials>,
    allowed: &[Role],
) -> Result<Role, Refusal> {
    let (a, b) = tokio::io::duplex(64 << 10);
    let acceptor = Acceptor::new(server, ALPN_KV, allowed, "test").unwrap();
    let client_side = async move {
        match client {
            // Kept open until the server is done with its side.
            Some(c) => Some(accept::connect(c, ALPN_KV, server.role(), b).await),
            None => {
                // A client with no certificate, trusting anything.
                use tokio::io::AsyncWriteExt;
                let mut b = b;
                let _ = b.write_all(b"GET / HTTP/1.1\r\n\r\n").await;
                None
            }
        }
    };
    let (served, _client) = tokio::join!(acceptor.accept(a, None), client_side);
    served.map(|(_, p)| p.role)
}

#[tokio::test]
async fn only_the_roles_a_listener_serves_get_in_and_strangers_are_refused_by_reason() {
    let dir = temp("handshake");
    let s = Store::at(dir.join("a"));
    let decode = s.credentials(Role::Decode, "d").unwrap();
    let prefill = s.credentials(Role::Prefill, "p").unwrap();
    let router = s.credentials(Role::Router, "r").unwrap();
    // A stranger with a certificate of its own CA, who knows ours (it is no secret).
    let own = Store::at(dir.join("b"))
        .credentials(Role::Prefill, "x")
        .unwrap();
    let (cert, key, _) = own.pems();
    let stranger = Credentials::from_pems(
        Role::Prefill,
        cert.into(),
        key.into(),
        prefill.pems().2.into(),
    )
    .unwrap();
    assert_eq!(
        handshake(&decode, Some(&prefill), &[Role::Prefill])
            .await
            .unwrap(),
        Role::Prefill
    );
    let wrong = handshake(&decode, Some(&router), &[Role::Prefill])
        .await
        .unwrap_err();
    assert_eq!(wrong.reason(), "wrong_role");
    let untrusted = handshake(&decode, Some(&stranger), &[Role::Prefill])
        .await
        .unwrap_err();
    assert_eq!(untrusted.reason(), "untrusted_certificate", "{untrusted}");
    let plain = handshake(&decode, None, &[Role::Prefill])
        .await
        .unwrap_err();
    assert_eq!(plain.reason(), "not_tls", "{plain}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn insecure_keeps_endpoints_and_mutual_dials_https() {
    assert_eq!(Security::Insecure.endpoint("http://a:1"), "http://a:1");
}
