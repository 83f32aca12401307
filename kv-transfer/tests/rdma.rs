//! RDMA on real hardware (feature `rdma`, a device, and `TANDEM_RDMA_TEST=1`):
//!
//! ```sh
//! TANDEM_RDMA_TEST=1 cargo test --release -p kv-transfer --features rdma --test rdma -- --ignored
//! ```
//!
//! A receiver registers a paged "KV pool" of its own, grants scattered blocks, and checks that
//! the sender's one-sided writes put every token of every layer exactly where the grant said,
//! that the CRCs match, and that the transport reported is RDMA. Without a device the probe
//! must say why (the negotiation test covers that path on every machine).
#![cfg(feature = "rdma")]

use std::time::Duration;

use kv_transfer::{
    rdma, KvEvent, KvRegions, KvSender, Layer, Layers, Local, Offer, Timeouts, Transport,
};
use proto::ModelIdentity;
use types::RequestId;

#[test]
fn probe_answers_with_devices_or_a_reason() {
    match rdma::probe() {
        Ok(devices) => assert!(!devices.is_empty()),
        Err(why) => assert!(why.contains("RDMA"), "{why}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs an RDMA device: TANDEM_RDMA_TEST=1 ... -- --ignored"]
async fn one_sided_writes_land_in_the_granted_blocks() {
    if std::env::var("TANDEM_RDMA_TEST").is_err() {
        return;
    }
    let identity = ModelIdentity {
        model: "rdma-test".into(),
        kv_dtype: "f16".into(),
        block_size: 16,
        n_layers: 3,
        n_kv_heads: 2,
        head_dim: 8,
        windows: vec![],
    };
    let (width, bs, blocks_total) = (16usize, 16usize, 32usize);
    let block_bytes = bs * width * 2;
    // The receiver's pool: per layer, keys then values, `blocks_total` blocks each.
    let mut pool: Vec<Vec<u8>> = (0..6)
        .map(|_| vec![0u8; blocks_total * block_bytes])
        .collect();
    let regions = KvRegions {
        layers: (0..3)
            .map(|l| {
                let k = pool[2 * l].as_mut_ptr() as usize;
                let v = pool[2 * l + 1].as_mut_ptr() as usize;
                [
                    (k, blocks_total * block_bytes),
                    (v, blocks_total * block_bytes),
                ]
            })
            .collect(),
        block_bytes,
        // The test's `pool` outlives the receiver (see below).
        owners: Vec::new(),
    };
    let side = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // SAFETY: `pool` outlives the receiver's use in this test (the test ends with it).
    let rx = unsafe { rdma::RdmaKvReceiver::bind(side, &regions) }.unwrap();
    let addr = rx.local_addr().unwrap();
    let (tx, mut events) = tokio::sync::mpsc::channel(8);
    tokio::spawn(rx.serve(Local::open(identity.clone()), tx, Timeouts::default()));
    let granted = vec![7u32, 2, 19];
    let g2 = granted.clone();
    let engine = tokio::spawn(async move {
        while let Some(ev) = events.recv().await {
            match ev {
                KvEvent::Grant { reply, .. } => {
                    let _ = reply.send(Ok(g2.clone()));
                }
                KvEvent::Complete(kv) => {
                    let crcs = kv.in_place.clone().expect("an in-place transfer");
                    kv.answer(Ok(()));
                    return crcs;
                }
                _ => {}
            }
        }
        panic!("no transfer arrived");
    });
    let n = 40usize; // three blocks, the last one partly filled
    let layers: Vec<Vec<u8>> = (0..3)
        .map(|l| (0..4 * n * width).map(|i| (i * 13 + l * 7) as u8).collect())
        .collect();
    let kv: Vec<Layer> = layers.iter().cloned().map(Layer::new).collect();
    let offer = Offer {
        transport: Transport::Rdma,
        endpoint: addr.to_string(),
        cert_der: vec![],
    };
    let t = Duration::from_secs(10);
    let mut s = KvSender::connect(&offer, &Local::open(identity), t)
        .await
        .unwrap();
    let stats = s
        .send(
            (RequestId(1), kv_transfer::TransferTicket::default()),
            n as u32,
            width as u32,
            Layers::Ready(&kv),
            t,
        )
        .await
        .unwrap();
    assert_eq!(stats.transport, Transport::Rdma);
    let crcs = engine.await.unwrap();
    for (l, data) in layers.iter().enumerate() {
        assert_eq!(crcs[l], crc32fast::hash(data));
        for p in 0..n {
            let b = granted[p / bs] as usize;
            let at = b * block_bytes + (p % bs) * width * 2;
            let k = &data[p * width * 2..(p + 1) * width * 2];
            let v = &data[(n + p) * width * 2..(n + p + 1) * width * 2];
            assert_eq!(
                &pool[2 * l][at..at + width * 2],
                k,
                "layer {l} token {p} keys"
            );
            assert_eq!(
                &pool[2 * l + 1][at..at + width * 2],
                v,
                "layer {l} token {p} values"
            );
        }
    }
}
