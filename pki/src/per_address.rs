//! Connections (or handshakes) counted per client address, so that one address cannot take
//! what a listener has for everyone.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// What each client address holds now.
#[derive(Debug, Clone, Default)]
pub struct PerAddress(Arc<Mutex<HashMap<IpAddr, usize>>>);

/// One slot of an address, given back when dropped.
#[derive(Debug)]
pub struct Held(PerAddress, IpAddr);

impl PerAddress {
    /// A slot for `ip`, unless it holds `max` already.
    pub fn take(&self, ip: IpAddr, max: usize) -> Option<Held> {
        let mut m = self.0.lock().expect("per-address lock");
        let n = m.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Held(self.clone(), ip))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut m = self.0 .0.lock().expect("per-address lock");
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_holds_at_most_its_share_and_gives_it_back() {
        let open = PerAddress::default();
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.1".parse().unwrap();
        let held: Vec<_> = (0..3).map(|_| open.take(a, 3).unwrap()).collect();
        assert!(open.take(a, 3).is_none(), "a fourth from the same address");
        assert!(
            open.take(b, 3).is_some(),
            "another address is not held back"
        );
        drop(held);
        assert!(open.0.lock().unwrap().get(&a).is_none());
        assert!(open.take(a, 3).is_some());
    }
}
