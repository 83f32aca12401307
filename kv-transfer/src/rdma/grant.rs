//! What a grant opens to a sender's one-sided writes: only the granted blocks. The receiver
//! registers, per layer and per keys/values pool, one memory region for each run of
//! consecutive granted blocks ([`runs`]) and sends their addresses and remote keys with the
//! grant ([`Access`]); the regions are deregistered as soon as the transfer is over, so a peer
//! never holds a key to any other request's KV (the whole pool is never registered).
//!
//! The layout of an access: the runs (`count: u32`, then `first: u32, blocks: u32` each), then
//! per layer, per pool (keys, values), per run: `addr: u64, rkey: u32` (little-endian).

use crate::TransferError;

/// One registered region: where the run starts in the receiver's address space, its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// The first granted block's address.
    pub addr: u64,
    /// The region's remote key.
    pub rkey: u32,
}

/// `blocks` as runs of consecutive ids, `(first, count)`, in order.
pub fn runs(blocks: &[u32]) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &b in blocks {
        match out.last_mut() {
            Some((first, n)) if first.checked_add(*n) == Some(b) => *n += 1,
            _ => out.push((b, 1)),
        }
    }
    out
}

/// A grant's access, as the sender reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    /// Runs of consecutive granted blocks.
    pub runs: Vec<(u32, u32)>,
    /// `regions[layer][pool][run]`.
    pub regions: Vec<[Vec<Region>; 2]>,
}

impl Access {
    /// The wire form.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend((self.runs.len() as u32).to_le_bytes());
        for &(first, n) in &self.runs {
            b.extend(first.to_le_bytes());
            b.extend(n.to_le_bytes());
        }
        for region in self.regions.iter().flatten().flatten() {
            b.extend(region.addr.to_le_bytes());
            b.extend(region.rkey.to_le_bytes());
        }
        b
    }

    /// Reads an access for `blocks` of a model of `n_layers`: its runs must be `blocks`'
    /// and every region present.
    pub fn decode(bytes: &[u8], blocks: &[u32], n_layers: usize) -> Result<Access, TransferError> {
        let bad = |why: &str| TransferError::Protocol(format!("the grant's RDMA access: {why}"));
        let mut r = super::Cursor(bytes);
        let n = r.u32()? as usize;
        if n > blocks.len() {
            return Err(bad("more runs than blocks"));
        }
        let runs = (0..n)
            .map(|_| Ok((r.u32()?, r.u32()?)))
            .collect::<Result<Vec<_>, TransferError>>()?;
        if runs != self::runs(blocks) {
            return Err(bad("its runs are not the granted blocks'"));
        }
        let mut pool = || -> Result<Vec<Region>, TransferError> {
            (0..n)
                .map(|_| {
                    Ok(Region {
                        addr: r.u64()?,
                        rkey: r.u32()?,
                    })
                })
                .collect()
        };
        let regions = (0..n_layers)
            .map(|_| Ok([pool()?, pool()?]))
            .collect::<Result<Vec<_>, TransferError>>()?;
        if !r.0.is_empty() {
            return Err(bad("trailing bytes"));
        }
        Ok(Access { runs, regions })
    }

    /// Where granted block number `j` (in grant order) of `layer`'s `pool` is: the address and
    /// key to write it with, blocks of `block_bytes` bytes; `None` past the grant.
    pub fn place(
        &self,
        (layer, pool): (usize, usize),
        j: usize,
        block_bytes: u64,
    ) -> Option<(u64, u32)> {
        let mut j = j as u64;
        for (i, &(_, n)) in self.runs.iter().enumerate() {
            if j < u64::from(n) {
                let region = self.regions.get(layer)?[pool][i];
                return Some((region.addr + j * block_bytes, region.rkey));
            }
            j -= u64::from(n);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_follow_consecutive_ids_in_grant_order() {
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(
            runs(&[4, 5, 6, 9, 2, 3, 3]),
            vec![(4, 3), (9, 1), (2, 2), (3, 1)]
        );
        assert_eq!(runs(&[u32::MAX, 0]), vec![(u32::MAX, 1), (0, 1)]);
    }

    #[test]
    fn an_access_round_trips_places_each_block_and_refuses_a_mismatch() {
        let blocks = [7, 8, 2];
        let region = |addr, rkey| Region { addr, rkey };
        let a = Access {
            runs: runs(&blocks),
            regions: vec![[
                vec![region(1000, 1), region(5000, 2)],
                vec![region(9000, 3), region(13000, 4)],
            ]],
        };
        let bytes = a.encode();
        assert_eq!(Access::decode(&bytes, &blocks, 1).unwrap(), a);
        assert_eq!(a.place((0, 0), 0, 100), Some((1000, 1)));
        assert_eq!(a.place((0, 0), 1, 100), Some((1100, 1)));
        assert_eq!(a.place((0, 1), 2, 100), Some((13000, 4)));
        assert_eq!(a.place((0, 1), 3, 100), None, "past the grant");
        assert_eq!(a.place((1, 0), 0, 100), None, "past the layers");
        for (bytes, blocks, layers) in [
            (&bytes[..], &[7, 8, 3][..], 1), // other blocks
            (&bytes[..], &blocks[..], 2),    // too few regions
            (&bytes[..bytes.len() - 1], &blocks[..], 1),
            (&[bytes.clone(), vec![0]].concat()[..], &blocks[..], 1),
        ] {
            assert!(Access::decode(bytes, blocks, layers).is_err());
        }
    }
}
