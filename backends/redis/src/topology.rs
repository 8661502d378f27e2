//! Hash slots and the slot map: which primary owns which of the 16384 slots.
//!
//! Keys never carry a hash tag (the key prefix may not contain braces and page names are
//! hex), so a key's slot is CRC16-XMODEM of the whole key modulo 16384, exactly as Redis
//! Cluster computes it, and a request's pages spread over every shard.

use crate::resp::Frame;

/// Number of hash slots of a Redis Cluster.
pub const SLOTS: usize = 16384;

/// The slot of `key` (the whole key: our keys have no hash tag).
pub fn slot(key: &[u8]) -> u16 {
    crc16_xmodem(key) % SLOTS as u16
}

/// CRC16-XMODEM (polynomial 0x1021, initial value 0, not reflected), as Redis Cluster hashes
/// keys, eight bytes per step (slicing-by-8): a page key is about 100 bytes and a batch
/// routes up to 1024 of them per call, where one byte per step took a quarter of the client's
/// time of `batch_exists`.
pub fn crc16_xmodem(data: &[u8]) -> u16 {
    let t = &CRC16_TABLES;
    let mut crc = 0u16;
    let mut chunks = data.chunks_exact(8);
    for c in &mut chunks {
        let [hi, lo] = crc.to_be_bytes();
        crc = t[7][usize::from(c[0] ^ hi)]
            ^ t[6][usize::from(c[1] ^ lo)]
            ^ t[5][usize::from(c[2])]
            ^ t[4][usize::from(c[3])]
            ^ t[3][usize::from(c[4])]
            ^ t[2][usize::from(c[5])]
            ^ t[1][usize::from(c[6])]
            ^ t[0][usize::from(c[7])];
    }
    for &b in chunks.remainder() {
        crc = (crc << 8) ^ t[0][usize::from((crc >> 8) as u8 ^ b)];
    }
    crc
}

/// `CRC16_TABLES[k][b]`: the CRC of byte `b` followed by `k` zero bytes.
static CRC16_TABLES: [[u16; 256]; 8] = crc16_tables();

const fn crc16_tables() -> [[u16; 256]; 8] {
    let mut t = [[0u16; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            c = if c & 0x8000 != 0 {
                (c << 1) ^ 0x1021
            } else {
                c << 1
            };
            bit += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut k = 1;
    while k < 8 {
        let mut i = 0;
        while i < 256 {
            let prev = t[k - 1][i];
            t[k][i] = (prev << 8) ^ t[0][(prev >> 8) as usize];
            i += 1;
        }
        k += 1;
    }
    t
}

/// Which node owns each slot. A standalone server owns every slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Primary addresses, `host:port`.
    pub nodes: Vec<String>,
    /// Slot → index into `nodes`; `u16::MAX` where no node serves the slot.
    owner: Vec<u16>,
}

impl Topology {
    /// One standalone server owning every slot.
    pub fn standalone(addr: &str) -> Self {
        Self {
            nodes: vec![addr.to_string()],
            owner: vec![0; SLOTS],
        }
    }

    /// Parses a `CLUSTER SLOTS` reply received from `from` (whose host stands in where the
    /// reply leaves a node's address empty).
    pub fn from_cluster_slots(reply: &Frame, from: &str) -> Result<Self, String> {
        let Frame::Array(ranges) = reply else {
            return Err(format!("expected an array, got {reply:?}"));
        };
        let from_host = crate::config::split_addr(from)
            .map(|(h, _)| h)
            .unwrap_or_default();
        let mut t = Self {
            nodes: Vec::new(),
            owner: vec![u16::MAX; SLOTS],
        };
        for r in ranges {
            let Frame::Array(fields) = r else {
                return Err(format!("expected a slot range array, got {r:?}"));
            };
            let (Some(Frame::Int(start)), Some(Frame::Int(end)), Some(Frame::Array(primary))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err(format!("malformed slot range {fields:?}"));
            };
            let host = match primary.first() {
                Some(Frame::Bulk(b)) => String::from_utf8_lossy(b).into_owned(),
                Some(Frame::Simple(s)) => s.clone(),
                _ => return Err(format!("malformed node entry {primary:?}")),
            };
            let host = if host.is_empty() || host == "?" {
                from_host.clone()
            } else {
                host
            };
            let Some(Frame::Int(port)) = primary.get(1) else {
                return Err(format!("malformed node entry {primary:?}"));
            };
            if !(0..=i64::from(u16::MAX)).contains(port) {
                return Err(format!("port {port} out of range"));
            }
            let addr = if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            if !(0..SLOTS as i64).contains(start) || !(0..SLOTS as i64).contains(end) || start > end
            {
                return Err(format!("slot range {start}-{end} out of bounds"));
            }
            let idx = match t.nodes.iter().position(|n| *n == addr) {
                Some(i) => i,
                None => {
                    t.nodes.push(addr);
                    t.nodes.len() - 1
                }
            };
            t.owner[*start as usize..=*end as usize].fill(idx as u16);
        }
        Ok(t)
    }

    /// The address owning `slot`, if any node serves it.
    pub fn owner(&self, slot: u16) -> Option<&str> {
        self.owner_index(slot).map(|i| self.nodes[i].as_str())
    }

    /// The index into [`nodes`](Self::nodes) of the primary that owns `slot`.
    pub fn owner_index(&self, slot: u16) -> Option<usize> {
        let i = *self.owner.get(slot as usize)? as usize;
        (i < self.nodes.len()).then_some(i)
    }

    /// How many slots no node serves.
    pub fn uncovered(&self) -> usize {
        self.owner.iter().filter(|o| **o == u16::MAX).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn crc16_by_eight_bytes_equals_the_reference(data in proptest::collection::vec(any::<u8>(), 0..300)) {
            prop_assert_eq!(
                crc16_xmodem(&data),
                crc16::State::<crc16::XMODEM>::calculate(&data)
            );
        }
    }

    #[test]
    fn slots_match_redis() {
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(slot(b"123456789"), 0x31C3);
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"bar"), 5061);
    }

    #[test]
    fn parses_cluster_slots() {
        let node = |h: &str, p: i64| {
            Frame::Array(vec![
                Frame::Bulk(h.as_bytes().to_vec()),
                Frame::Int(p),
                Frame::Bulk(b"id".to_vec()),
            ])
        };
        let reply = Frame::Array(vec![
            Frame::Array(vec![
                Frame::Int(0),
                Frame::Int(8000),
                node("10.0.0.1", 7000),
                node("10.0.0.2", 7003),
            ]),
            Frame::Array(vec![Frame::Int(8001), Frame::Int(16383), node("", 7001)]),
        ]);
        let t = Topology::from_cluster_slots(&reply, "10.0.0.9:7001").unwrap();
        assert_eq!(t.owner(0), Some("10.0.0.1:7000"));
        assert_eq!(t.owner(8000), Some("10.0.0.1:7000"));
        assert_eq!(t.owner(16383), Some("10.0.0.9:7001"));
        assert_eq!(t.uncovered(), 0);
        assert!(Topology::from_cluster_slots(&Frame::Int(1), "h:1").is_err());
        let bad = Frame::Array(vec![Frame::Array(vec![
            Frame::Int(-1),
            Frame::Int(5),
            node("a", 1),
        ])]);
        assert!(Topology::from_cluster_slots(&bad, "h:1").is_err());
    }
}
