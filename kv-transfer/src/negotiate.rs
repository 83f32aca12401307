//! Choosing a transport per peer: the decode worker offers what it listens on, the prefill
//! worker knows what it can use, the configured preference orders them. The choice and its
//! reason are returned so that callers log it; `require` fails closed instead of falling back.

use crate::{TransferError, Transport};

/// One way to reach a decode worker's KV pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    /// The transport.
    pub transport: Transport,
    /// Where (`host:port`).
    pub endpoint: String,
    /// For QUIC: the certificate to pin.
    pub cert_der: Vec<u8>,
}

impl Offer {
    /// The offer a decode worker announced (`None` for a transport this build does not know).
    pub fn from_wire(o: &proto::grpc::KvOffer) -> Option<Offer> {
        Some(Offer {
            transport: o.transport.parse().ok()?,
            endpoint: o.endpoint.clone(),
            cert_der: o.cert_der.clone(),
        })
    }
}

/// Transports this build and machine can use, and why the others cannot be (RDMA needs the
/// `rdma` feature and a device). Probed once per process.
pub fn local_transports() -> (Vec<Transport>, Vec<String>) {
    static PROBED: std::sync::OnceLock<(Vec<Transport>, Vec<String>)> = std::sync::OnceLock::new();
    PROBED
        .get_or_init(|| match crate::rdma::probe() {
            Ok(_) => (
                vec![Transport::Rdma, Transport::Quic, Transport::Tcp],
                vec![],
            ),
            Err(why) => (
                vec![Transport::Quic, Transport::Tcp],
                vec![format!("rdma: {why}")],
            ),
        })
        .clone()
}

/// Picks the first transport in `prefer` that the peer offers and this side has. With
/// `require`, only that transport is acceptable.
pub fn choose(
    offers: &[Offer],
    local: &[Transport],
    prefer: &[Transport],
    require: Option<Transport>,
) -> Result<(Offer, String), TransferError> {
    let (_, missing) = local_transports();
    let order: Vec<Transport> = match require {
        Some(t) => vec![t],
        None => prefer.to_vec(),
    };
    let mut skipped = Vec::new();
    for t in order {
        let offered = offers.iter().find(|o| o.transport == t);
        match (offered, local.contains(&t)) {
            (Some(o), true) => {
                let why = if skipped.is_empty() {
                    format!("{t} (first preference)")
                } else {
                    format!("{t} ({})", skipped.join("; "))
                };
                return Ok((o.clone(), why));
            }
            (None, true) => skipped.push(format!("{t} not offered by the peer")),
            // What this side lacks is the more useful reason (the peer cannot offer what
            // neither end would use).
            (_, false) => skipped.push(
                missing
                    .iter()
                    .find(|m| m.starts_with(t.name()))
                    .cloned()
                    .unwrap_or(format!("{t} not available here")),
            ),
        }
    }
    Err(TransferError::Refused(match require {
        Some(t) => format!(
            "transport {t} is required but unavailable: {}",
            skipped.join("; ")
        ),
        None => format!("no common transport: {}", skipped.join("; ")),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(t: Transport) -> Offer {
        Offer {
            transport: t,
            endpoint: "127.0.0.1:1".into(),
            cert_der: vec![],
        }
    }

    #[test]
    fn preference_availability_and_require() {
        let offers = [offer(Transport::Tcp), offer(Transport::Quic)];
        let local = [Transport::Quic, Transport::Tcp];
        let all = [Transport::Rdma, Transport::Quic, Transport::Tcp];
        let (o, why) = choose(&offers, &local, &all, None).unwrap();
        assert_eq!(o.transport, Transport::Quic);
        assert!(why.contains("rdma: "), "{why}");
        let (o, why) = choose(&offers, &[Transport::Rdma, Transport::Tcp], &all, None).unwrap();
        assert_eq!(o.transport, Transport::Tcp);
        assert!(why.contains("rdma not offered by the peer"), "{why}");
        let (o, _) = choose(&offers, &local, &[Transport::Tcp, Transport::Quic], None).unwrap();
        assert_eq!(o.transport, Transport::Tcp);
        let with_rdma = [offer(Transport::Rdma), offer(Transport::Tcp)];
        let (o, why) = choose(&with_rdma, &local, &all, None).unwrap();
        assert_eq!(o.transport, Transport::Tcp);
        if let Some(m) = local_transports().1.first() {
            assert!(why.contains(m), "{why}");
        }
        let e = choose(&with_rdma, &local, &all, Some(Transport::Rdma))
            .unwrap_err()
            .to_string();
        assert!(e.contains("rdma is required but unavailable"), "{e}");
        assert!(choose(&[], &local, &all, None).is_err());
    }
}
