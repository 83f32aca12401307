//! Both transports on loopback: the bytes arrive whole, the receiver's verdict comes back, and a
//! peer with another KV layout is refused at the handshake.

use std::time::Duration;

use std::sync::Arc;

use kv_transfer::{
    quic::QuicKvReceiver, IncomingKv, KvEvent, KvSender, Layer, Local, Offer, Timeouts, Transport,
};
use proto::ModelIdentity;
use tokio::sync::mpsc;
use types::RequestId;

fn identity(block_size: u32) -> ModelIdentity {
    ModelIdentity {
        model: "m".into(),
        kv_dtype: "f16".into(),
        block_size,
        n_layers: 3,
        n_kv_heads: 2,
        head_dim: 8,
        windows: vec![],
    }
}

fn local(block_size: u32, secret: Option<&str>) -> Local {
    Local {
        identity: identity(block_size),
        secret: secret.map(|s| Arc::new(s.as_bytes().to_vec())),
        security: pki::Security::Insecure,
        max_kv_tokens: u32::MAX,
        tickets: None,
    }
}

async fn receivers() -> (Vec<Offer>, mpsc::Receiver<IncomingKv>) {
    receivers_with(None).await
}

/// Listeners on TCP and QUIC; whole transfers come out of the returned channel (the
/// `Arriving`/`Abandoned` notices a decode worker also gets are dropped here).
async fn receivers_with(secret: Option<&str>) -> (Vec<Offer>, mpsc::Receiver<IncomingKv>) {
    let (tx, mut events) = mpsc::channel(4);
    let (whole, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            if let KvEvent::Complete(kv) = ev {
                if whole.send(kv).await.is_err() {
                    return;
                }
            }
        }
    });
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tcp_addr = tcp.local_addr().unwrap();
    tokio::spawn(kv_transfer::tcp::serve(
        tcp,
        local(16, secret),
        tx.clone(),
        Timeouts::default(),
    ));
    let quic =
        QuicKvReceiver::bind("127.0.0.1:0".parse().unwrap(), &pki::Security::Insecure).unwrap();
    let quic_addr = quic.local_addr().unwrap();
    let cert = quic.cert_der.clone();
    tokio::spawn(quic.serve(local(16, secret), tx, Timeouts::default()));
    let offers = vec![
        Offer {
            transport: Transport::Tcp,
            endpoint: tcp_addr.to_string(),
            cert_der: vec![],
        },
        Offer {
            transport: Transport::Quic,
            endpoint: quic_addr.to_string(),
            cert_der: cert,
        },
    ];
    (offers, rx)
}

#[tokio::test]
async fn kv_arrives_whole_over_tcp_and_quic_and_bad_peers_are_refused() {
    let (offers, mut rx) = receivers().await;
    // The receiving "engine": accepts even request ids, refuses odd ones.
    let got = tokio::spawn(async move {
        let mut seen = Vec::new();
        while let Some(kv) = rx.recv().await {
            let ok = kv.request_id.0 % 2 == 0;
            seen.push((kv.request_id, kv.transport, kv.n_tokens, kv.layers.clone()));
            kv.answer(if ok { Ok(()) } else { Err("no room".into()) });
            if seen.len() == 4 {
                return seen;
            }
        }
        seen
    });
    let width = 16u32;
    let layers: Vec<Vec<u8>> = (0..3)
        .map(|l| {
            (0..4 * 5 * width as usize)
                .map(|i| (i * 7 + l) as u8)
                .collect()
        })
        .collect();
    // Checksummed where produced, as the prefill worker does.
    let kv: Vec<Layer> = layers.iter().cloned().map(Layer::new).collect();
    let t = Duration::from_secs(5);
    for offer in &offers {
        let mut s = KvSender::connect(offer, &local(16, None), t).await.unwrap();
        let stats = s
            .send(
                (RequestId(2), kv_transfer::TransferTicket::default()),
                5,
                width,
                kv_transfer::Layers::Ready(&kv),
                t,
            )
            .await
            .unwrap();
        assert_eq!(stats.transport, offer.transport);
        assert_eq!(stats.bytes, 3 * 4 * 5 * 16);
        let e = s
            .send(
                (RequestId(3), kv_transfer::TransferTicket::default()),
                5,
                width,
                kv_transfer::Layers::Ready(&kv),
                t,
            )
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("no room"), "{e}");
        // A peer with another block size is refused before any KV moves.
        let refused = match KvSender::connect(offer, &local(32, None), t).await {
            Ok(mut s) => s
                .send(
                    (RequestId(4), kv_transfer::TransferTicket::default()),
                    5,
                    width,
                    kv_transfer::Layers::Ready(&kv),
                    t,
                )
                .await
                .map(|_| ()),
            Err(e) => Err(e),
        };
        let e = refused.unwrap_err().to_string();
        assert!(
            e.contains("block_size: 16 vs 32"),
            "{}: {e}",
            offer.transport
        );
    }
    let seen = got.await.unwrap();
    assert_eq!(seen.len(), 4);
    for (id, transport, n, l) in seen {
        assert!(id == RequestId(2) || id == RequestId(3));
        assert!(matches!(transport, Transport::Tcp | Transport::Quic));
        assert_eq!(n, 5);
        assert_eq!(l, layers);
    }
}

#[tokio::test]
async fn a_silent_receiver_times_out_instead_of_hanging() {
    // Accepts the TCP connection but never answers the handshake.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let _hold = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(s);
    });
    let offer = Offer {
        transport: Transport::Tcp,
        endpoint: addr.to_string(),
        cert_der: vec![],
    };
    let e = match KvSender::connect(&offer, &local(16, None), Duration::from_millis(300)).await {
        Ok(_) => panic!("connected to a silent peer"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("timed out"), "{e}");
}

#[tokio::test]
async fn only_holders_of_the_cluster_secret_may_write_kv() {
    let (offers, mut rx) = receivers_with(Some("s3cret")).await;
    let t = Duration::from_secs(5);
    let layers: Vec<Layer> = (0..3).map(|_| Layer::new(vec![1u8; 4 * 16])).collect();
    for offer in &offers {
        for (secret, needle) in [
            (None, "requires the cluster secret"),
            (Some("guess"), "wrong cluster secret"),
        ] {
            let r = match KvSender::connect(offer, &local(16, secret), t).await {
                Ok(mut s) => s
                    .send(
                        (RequestId(1), kv_transfer::TransferTicket::default()),
                        1,
                        16,
                        kv_transfer::Layers::Ready(&layers),
                        t,
                    )
                    .await
                    .map(|_| ()),
                Err(e) => Err(e),
            };
            let e = r.unwrap_err().to_string();
            assert!(e.contains(needle), "{}: {e}", offer.transport);
        }
        let mut s = KvSender::connect(offer, &local(16, Some("s3cret")), t)
            .await
            .unwrap();
        let l2 = layers.clone();
        let sent = tokio::spawn(async move {
            s.send(
                (RequestId(8), kv_transfer::TransferTicket::default()),
                1,
                16,
                kv_transfer::Layers::Ready(&l2),
                Duration::from_secs(5),
            )
            .await
            .map(|_| ())
        });
        let kv = rx.recv().await.expect("the authenticated transfer arrives");
        assert_eq!(kv.request_id, RequestId(8));
        kv.answer(Ok(()));
        sent.await.unwrap().unwrap();
    }
    // Nothing from the refused peers ever reached the receiver.
    assert!(rx.try_recv().is_err());
}

/// A receiver that stops reading for longer than a renewal period (its engine busy: here its
/// events go untaken) slows the sender's writes; they wait, up to the transfer's deadline,
/// instead of being cut at the next renewal — which failed transfers that were only slowed,
/// reported as "writing the KV … for 10s" a second after they began.
#[tokio::test]
async fn a_receiver_behind_for_longer_than_a_renewal_slows_the_write_without_failing_it() {
    // One event buffered: the first transfer's `Arriving` fills it, the second connection
    // stops reading at its `Begin` until the events are taken.
    let (tx, mut events) = mpsc::channel(1);
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let offer = Offer {
        transport: Transport::Tcp,
        endpoint: tcp.local_addr().unwrap().to_string(),
        cert_der: vec![],
    };
    tokio::spawn(kv_transfer::tcp::serve(
        tcp,
        local(16, None),
        tx,
        Timeouts::default(),
    ));
    // 16 MiB a layer: far more than the sockets buffer.
    let (width, n) = (16u32, 1u32 << 18);
    let layer: Vec<u8> = (0..4 * n as usize * width as usize)
        .map(|i| i as u8)
        .collect();
    let kv: Arc<Vec<Layer>> = Arc::new((0..3).map(|_| Layer::new(layer.clone())).collect());
    let send = |id: u64| {
        let (offer, kv) = (offer.clone(), kv.clone());
        tokio::spawn(async move {
            let t = Duration::from_secs(10);
            let mut s = KvSender::connect(&offer, &local(16, None), t).await?;
            let ticket = kv_transfer::TransferTicket::default();
            let ready = kv_transfer::Layers::Ready(&kv);
            s.send((RequestId(id), ticket), n, width, ready, t).await
        })
    };
    let (a, b) = (send(2), send(4));
    // The renewal period is 1 s: the receiver stays behind for 2.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut complete = 0;
    while complete < 2 {
        match events.recv().await.expect("the receiver runs") {
            KvEvent::Complete(kv) => {
                assert_eq!(kv.layers[2].len(), layer.len());
                kv.answer(Ok(()));
                complete += 1;
            }
            KvEvent::Abandoned { error, .. } => panic!("a transfer was abandoned: {error}"),
            _ => {}
        }
    }
    for sent in [a, b] {
        let stats = sent.await.unwrap().expect("slowed, not failed");
        assert_eq!(stats.bytes, 3 * layer.len() as u64);
    }
}
