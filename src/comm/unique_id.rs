//! TEMPORARY placeholder (replaced by the bootstrap work).
use crate::error::{Error, Result};
/// Bytes in an id.
pub const UNIQUE_ID_BYTES: usize = 128;
/// An NCCL unique id.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct UniqueId(pub(crate) [u8; UNIQUE_ID_BYTES]);
impl UniqueId {
    /// From bytes.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let a: [u8; 128] = b.try_into().map_err(|_| Error::MalformedUniqueId(format!("{} bytes", b.len())))?;
        Ok(UniqueId(a))
    }
    /// Bytes.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] { &self.0 }
    /// hex
    pub fn to_hex(&self) -> String { self.0.iter().map(|b| format!("{b:02x}")).collect() }
    /// from hex
    pub fn from_hex(s: &str) -> Result<Self> {
        let b: Vec<u8> = (0..s.len()/2).map(|i| u8::from_str_radix(&s[2*i..2*i+2], 16).unwrap_or(0)).collect();
        Self::from_bytes(&b)
    }
}
