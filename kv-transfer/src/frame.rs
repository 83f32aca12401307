//! The framed wire format of the TCP transport (no I/O here).
//!
//! Every frame is `kind: u8, len: u32, crc32: u32, payload[len]` (little-endian); the CRC covers
//! the payload and is checked before a frame is used.
//!
//! A connection starts with `Hello` (magic, protocol version, model identity) answered by
//! `HelloOk` or `Refuse`. Then transfers follow one after another: `Begin` (request id, the
//! receiver's transfer ticket for it, tokens, layers, width), one `Layer` per layer (request id, layer index, keys then values as f16),
//! answered by one `Ack` (request id, ok flag, message). In-place (RDMA) transfers replace the
//! `Layer` frames by `Grant` (the receiver's block ids) and one `Written` (layer, CRC) per layer
//! whose bytes were written into those blocks directly.

use proto::ModelIdentity;

/// Connection preamble.
pub const MAGIC: [u8; 4] = *b"TKV1";
/// Largest frame accepted (a layer of a 256k-token request of a large model fits).
pub const MAX_FRAME: u32 = 1 << 30;
/// Bytes of a frame header.
pub const HEADER: usize = 9;

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Client hello.
    Hello {
        /// [`proto::PROTOCOL_VERSION`] of the sender.
        version: u32,
        /// What the sender computes with.
        identity: ModelIdentity,
    },
    /// The server accepts the connection.
    HelloOk,
    /// The server refuses, with the reason.
    Refuse(String),
    /// The server asks for proof of the cluster secret over this nonce.
    Challenge([u8; 16]),
    /// HMAC-SHA256 of the challenge (see `wire::hello`).
    Proof(Vec<u8>),
    /// A transfer starts.
    Begin {
        /// The request the KV belongs to.
        request_id: u64,
        /// The receiver's permission for this transfer (issued with the reservation).
        ticket: types::TransferTicket,
        /// Tokens covered.
        n_tokens: u32,
        /// Layers that follow.
        n_layers: u32,
        /// Values per token per layer for keys (and again for values).
        width: u32,
    },
    /// One layer's keys then values, f16 little-endian.
    Layer {
        /// The request the KV belongs to.
        request_id: u64,
        /// Layer index.
        layer: u32,
        /// The bytes.
        data: Vec<u8>,
    },
    /// In-place (RDMA) transfers: the receiver's KV blocks for a request, in token order, that
    /// the sender writes into directly.
    Grant {
        /// The request.
        request_id: u64,
        /// Block ids in the receiver's pool.
        blocks: Vec<u32>,
        /// The transport's access to those blocks alone, opaque to the protocol (RDMA: the
        /// regions registered for this grant and their keys).
        access: Vec<u8>,
    },
    /// In-place transfers: one layer has been written into the granted blocks; the CRC32 of
    /// its bytes in the wire layout (keys then values), checked by the receiver before admitting.
    Written {
        /// The request.
        request_id: u64,
        /// Layer index.
        layer: u32,
        /// CRC32 of the layer's bytes.
        crc: u32,
    },
    /// Transport setup after the handshake (RDMA: queue-pair endpoints and memory keys),
    /// opaque to the protocol core.
    Setup(Vec<u8>),
    /// The sender is alive and still working on a request's KV (queued or computing): the
    /// receiver extends the lease on the blocks it reserved for it.
    Renew {
        /// The request.
        request_id: u64,
    },
    /// The receiver's verdict on a whole transfer.
    Ack {
        /// The request.
        request_id: u64,
        /// Whether the KV was admitted.
        ok: bool,
        /// Why not, when not.
        message: String,
    },
}

/// A malformed frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed KV-transfer frame: {0}")]
pub struct FrameError(pub String);

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], FrameError> {
        if self.0.len() < n {
            return Err(FrameError(format!(
                "needs {n} more bytes, has {}",
                self.0.len()
            )));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, FrameError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, FrameError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn string(&mut self) -> Result<String, FrameError> {
        let n = self.u32()? as usize;
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| FrameError("string is not UTF-8".into()))
    }
    fn end(&self) -> Result<(), FrameError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(FrameError(format!("{} trailing bytes", self.0.len())))
        }
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u32).to_le_bytes());
    b.extend(s.as_bytes());
}

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Frame::Hello { .. } => 1,
            Frame::HelloOk => 2,
            Frame::Refuse(_) => 3,
            Frame::Begin { .. } => 4,
            Frame::Layer { .. } => 5,
            Frame::Ack { .. } => 6,
            Frame::Challenge(_) => 7,
            Frame::Proof(_) => 8,
            Frame::Grant { .. } => 9,
            Frame::Written { .. } => 10,
            Frame::Setup(_) => 11,
            Frame::Renew { .. } => 12,
        }
    }

    /// The frame's name, for messages that must not echo its contents.
    pub fn name(&self) -> &'static str {
        match self {
            Frame::Hello { .. } => "Hello",
            Frame::HelloOk => "HelloOk",
            Frame::Refuse(_) => "Refuse",
            Frame::Begin { .. } => "Begin",
            Frame::Layer { .. } => "Layer",
            Frame::Ack { .. } => "Ack",
            Frame::Challenge(_) => "Challenge",
            Frame::Proof(_) => "Proof",
            Frame::Grant { .. } => "Grant",
            Frame::Written { .. } => "Written",
            Frame::Setup(_) => "Setup",
            Frame::Renew { .. } => "Renew",
        }
    }

    /// The frame's bytes, header included.
    pub fn encode(&self) -> Vec<u8> {
        let mut p = Vec::new();
        match self {
            Frame::Hello {
                version,
                identity: i,
            } => {
                p.extend(MAGIC);
                p.extend(version.to_le_bytes());
                put_str(&mut p, &i.model);
                put_str(&mut p, &i.kv_dtype);
                for v in [i.block_size, i.n_layers, i.n_kv_heads, i.head_dim] {
                    p.extend(v.to_le_bytes());
                }
                p.extend((i.windows.len() as u32).to_le_bytes());
                for w in &i.windows {
                    p.extend(w.to_le_bytes());
                }
            }
            Frame::HelloOk => {}
            Frame::Challenge(n) => p.extend(n),
            Frame::Proof(t) | Frame::Setup(t) => p.extend(t),
            Frame::Refuse(m) => put_str(&mut p, m),
            Frame::Begin {
                request_id,
                ticket,
                n_tokens,
                n_layers,
                width,
            } => {
                p.extend(request_id.to_le_bytes());
                p.extend(ticket.0);
                for v in [n_tokens, n_layers, width] {
                    p.extend(v.to_le_bytes());
                }
            }
            Frame::Layer {
                request_id,
                layer,
                data,
            } => {
                p.reserve(12 + data.len());
                p.extend(request_id.to_le_bytes());
                p.extend(layer.to_le_bytes());
                p.extend(data);
            }
            Frame::Grant {
                request_id,
                blocks,
                access,
            } => {
                p.extend(request_id.to_le_bytes());
                p.extend((blocks.len() as u32).to_le_bytes());
                for b in blocks {
                    p.extend(b.to_le_bytes());
                }
                p.extend(access);
            }
            Frame::Written {
                request_id,
                layer,
                crc,
            } => {
                p.extend(request_id.to_le_bytes());
                p.extend(layer.to_le_bytes());
                p.extend(crc.to_le_bytes());
            }
            Frame::Renew { request_id } => p.extend(request_id.to_le_bytes()),
            Frame::Ack {
                request_id,
                ok,
                message,
            } => {
                p.extend(request_id.to_le_bytes());
                p.push(*ok as u8);
                put_str(&mut p, message);
            }
        }
        let mut out = Vec::with_capacity(HEADER + p.len());
        out.push(self.kind());
        out.extend((p.len() as u32).to_le_bytes());
        out.extend(crc32fast::hash(&p).to_le_bytes());
        out.extend(p);
        out
    }

    /// Parses a frame header: (kind, payload length, crc).
    pub fn header(h: &[u8; HEADER]) -> Result<(u8, u32, u32), FrameError> {
        let len = u32::from_le_bytes(h[1..5].try_into().expect("4"));
        if len > MAX_FRAME {
            return Err(FrameError(format!(
                "frame of {len} bytes exceeds the limit of {MAX_FRAME}"
            )));
        }
        Ok((
            h[0],
            len,
            u32::from_le_bytes(h[5..9].try_into().expect("4")),
        ))
    }

    /// Decodes a payload of `kind` after checking its CRC.
    pub fn decode(kind: u8, crc: u32, payload: &[u8]) -> Result<Frame, FrameError> {
        let got = crc32fast::hash(payload);
        if got != crc {
            return Err(FrameError(format!(
                "checksum mismatch (frame says {crc:08x}, payload has {got:08x})"
            )));
        }
        let mut r = Reader(payload);
        let f = match kind {
            1 => {
                if r.take(4)? != MAGIC {
                    return Err(FrameError("bad magic".into()));
                }
                let version = r.u32()?;
                let model = r.string()?;
                let kv_dtype = r.string()?;
                let (block_size, n_layers, n_kv_heads, head_dim) =
                    (r.u32()?, r.u32()?, r.u32()?, r.u32()?);
                let n = r.u32()?;
                if n != 0 && n != n_layers {
                    return Err(FrameError(format!(
                        "{n} layer windows for {n_layers} layers"
                    )));
                }
                let windows = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
                Frame::Hello {
                    version,
                    identity: ModelIdentity {
                        model,
                        kv_dtype,
                        block_size,
                        n_layers,
                        n_kv_heads,
                        head_dim,
                        windows,
                    },
                }
            }
            2 => Frame::HelloOk,
            3 => Frame::Refuse(r.string()?),
            4 => Frame::Begin {
                request_id: r.u64()?,
                ticket: types::TransferTicket(r.take(16)?.try_into().expect("16")),
                n_tokens: r.u32()?,
                n_layers: r.u32()?,
                width: r.u32()?,
            },
            5 => {
                let request_id = r.u64()?;
                let layer = r.u32()?;
                let data = std::mem::take(&mut r.0).to_vec();
                Frame::Layer {
                    request_id,
                    layer,
                    data,
                }
            }
            6 => {
                let request_id = r.u64()?;
                let ok = r.take(1)?[0] != 0;
                Frame::Ack {
                    request_id,
                    ok,
                    message: r.string()?,
                }
            }
            7 => Frame::Challenge(r.take(16)?.try_into().expect("16")),
            8 => Frame::Proof(std::mem::take(&mut r.0).to_vec()),
            9 => {
                let request_id = r.u64()?;
                let n = r.u32()? as usize;
                if n > r.0.len() / 4 {
                    return Err(FrameError(format!("grant of {n} blocks in a short frame")));
                }
                let blocks = (0..n).map(|_| r.u32()).collect::<Result<_, _>>()?;
                let access = std::mem::take(&mut r.0).to_vec();
                Frame::Grant {
                    request_id,
                    blocks,
                    access,
                }
            }
            11 => Frame::Setup(std::mem::take(&mut r.0).to_vec()),
            10 => Frame::Written {
                request_id: r.u64()?,
                layer: r.u32()?,
                crc: r.u32()?,
            },
            12 => Frame::Renew {
                request_id: r.u64()?,
            },
            k => return Err(FrameError(format!("unknown frame kind {k}"))),
        };
        r.end()?;
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(f: Frame) {
        let b = f.encode();
        let (kind, len, crc) = Frame::header(b[..HEADER].try_into().unwrap()).unwrap();
        assert_eq!(len as usize, b.len() - HEADER);
        assert_eq!(Frame::decode(kind, crc, &b[HEADER..]).unwrap(), f);
    }

    #[test]
    fn frames_roundtrip_and_corruption_is_caught() {
        let identity = ModelIdentity {
            model: "m".into(),
            kv_dtype: "f16".into(),
            block_size: 16,
            n_layers: 2,
            n_kv_heads: 3,
            head_dim: 64,
            windows: vec![0, 512],
        };
        roundtrip(Frame::Hello {
            version: 1,
            identity,
        });
        roundtrip(Frame::HelloOk);
        roundtrip(Frame::Challenge([7; 16]));
        roundtrip(Frame::Proof(vec![1; 32]));
        roundtrip(Frame::Refuse("no".into()));
        roundtrip(Frame::Begin {
            request_id: 7,
            ticket: types::TransferTicket([9; 16]),
            n_tokens: 5,
            n_layers: 2,
            width: 192,
        });
        roundtrip(Frame::Layer {
            request_id: 7,
            layer: 1,
            data: vec![1, 2, 3],
        });
        roundtrip(Frame::Grant {
            request_id: 7,
            blocks: vec![3, 1, 4],
            access: vec![1, 5, 9],
        });
        roundtrip(Frame::Setup(vec![5; 40]));
        roundtrip(Frame::Written {
            request_id: 7,
            layer: 2,
            crc: 0xdead_beef,
        });
        roundtrip(Frame::Ack {
            request_id: 7,
            ok: false,
            message: "full".into(),
        });
        let mut b = Frame::Layer {
            request_id: 7,
            layer: 1,
            data: vec![9; 100],
        }
        .encode();
        b[50] ^= 1;
        let (kind, _, crc) = Frame::header(b[..HEADER].try_into().unwrap()).unwrap();
        assert!(Frame::decode(kind, crc, &b[HEADER..])
            .unwrap_err()
            .0
            .contains("checksum"));
        // Truncated, unknown and oversized frames are errors, not panics.
        let b = Frame::Begin {
            request_id: 1,
            ticket: types::TransferTicket::default(),
            n_tokens: 1,
            n_layers: 1,
            width: 1,
        }
        .encode();
        let p = &b[HEADER..b.len() - 2];
        assert!(Frame::decode(4, crc32fast::hash(p), p).is_err());
        assert!(Frame::decode(99, crc32fast::hash(&[]), &[]).is_err());
        let mut h = [0u8; HEADER];
        h[1..5].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Frame::header(&h).is_err());
    }
}

#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Arbitrary bytes never panic the parser, whatever kind and checksum they claim.
        #[test]
        fn arbitrary_payloads_never_panic(kind in any::<u8>(), bytes in proptest::collection::vec(any::<u8>(), 0..512), honest_crc in any::<bool>()) {
            let crc = if honest_crc { crc32fast::hash(&bytes) } else { 0xdead_beef };
            let _ = Frame::decode(kind, crc, &bytes);
            let mut h = [0u8; HEADER];
            for (d, s) in h.iter_mut().zip(bytes.iter()) { *d = *s; }
            let _ = Frame::header(&h);
        }

        /// Encoded frames decode to themselves; one flipped payload bit is always caught.
        #[test]
        fn roundtrip_and_bit_flips(id in any::<u64>(), layer in any::<u32>(), data in proptest::collection::vec(any::<u8>(), 1..256), bit in any::<usize>()) {
            let f = Frame::Layer { request_id: id, layer, data };
            let mut b = f.encode();
            let (kind, _, crc) = Frame::header(b[..HEADER].try_into().unwrap()).unwrap();
            prop_assert_eq!(Frame::decode(kind, crc, &b[HEADER..]).unwrap(), f);
            let i = HEADER * 8 + bit % ((b.len() - HEADER) * 8);
            b[i / 8] ^= 1 << (i % 8);
            prop_assert!(Frame::decode(kind, crc, &b[HEADER..]).is_err());
        }
    }
}
