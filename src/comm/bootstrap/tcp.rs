//! The TCP rendezvous: rank 0 listens, the other ranks connect and get the id.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use super::{check_world, deadline_after, time_left};
use crate::comm::unique_id::{UniqueId, UNIQUE_ID_BYTES};
use crate::error::{Error, Result};

// Protocol (all integers little-endian):
//
//   peer -> rank 0   hello:  b"TPFUSE01", u32 rank, u32 world                 (16 bytes)
//   rank 0 -> peer   reply:  b"TPFUSE01", u8 status, then
//                            status 0: the 128 bytes of the unique id
//                            status 1: u32 length, that many bytes of UTF-8 error message
//
// Rank 0 accepts connections until ranks 1..world have each said hello once, then sends
// every peer the id. A hello with bad magic, another world size, a rank outside 1..world
// or a rank already seen aborts the rendezvous: rank 0 sends an error reply to the
// offender and to every peer already waiting (so nobody waits for the timeout) and
// returns the error. Each side closes its connection after the reply.

const TCP_MAGIC: [u8; 8] = *b"TPFUSE01";
const HELLO_BYTES: usize = 16;
const STATUS_OK: u8 = 0;
const STATUS_ERROR: u8 = 1;
/// The longest error message a peer accepts.
const MAX_MESSAGE_BYTES: u32 = 64 * 1024;
/// How long a reply may take to write; replies are small, so this only matters for a peer
/// that stopped reading.
const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// The pause between two looks for a new connection on rank 0.
const ACCEPT_POLL: Duration = Duration::from_millis(5);

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Serves `id` to ranks `1..world` on `listener_addr` (rank 0's side of the TCP
/// rendezvous).
///
/// Binds a listener and runs [`serve_tcp_on`]. With `world == 1` there is nobody to serve:
/// it returns at once without binding.
///
/// # Errors
///
/// [`Error::Io`] when the address cannot be bound, otherwise as [`serve_tcp_on`].
pub fn serve_tcp(
    listener_addr: impl ToSocketAddrs,
    world: usize,
    id: &UniqueId,
    timeout: Duration,
) -> Result<()> {
    check_world(world)?;
    if world == 1 {
        return Ok(());
    }
    let listener = TcpListener::bind(listener_addr)
        .map_err(|e| Error::io("binding the rendezvous listener", e))?;
    serve_tcp_on(listener, world, id, timeout)
}

/// Serves `id` to ranks `1..world` on an already bound `listener`, returning once every one
/// of them has received it.
///
/// Connections are accepted until each of ranks `1..world` has said hello once, all within
/// `timeout`; then each gets the id. A peer that breaks the protocol aborts the rendezvous
/// for everybody: the offender and every peer already connected get an error reply.
///
/// # Errors
///
/// - [`Error::Rendezvous`] (naming the peer's address) for a peer that sends something that
///   is not a tpfuse hello or closes its connection early, or when a reply cannot be sent.
/// - [`Error::WorldSizeMismatch`] for a peer with another world size.
/// - [`Error::RankOutOfRange`] for a peer whose rank is not in `1..world`.
/// - [`Error::DuplicateRank`] for a second peer with the same rank.
/// - [`Error::Timeout`] when some ranks have not said hello within `timeout`; the text
///   lists them.
/// - [`Error::Io`] when the listener fails; [`Error::InvalidArgument`] for `world == 0`.
pub fn serve_tcp_on(
    listener: TcpListener,
    world: usize,
    id: &UniqueId,
    timeout: Duration,
) -> Result<()> {
    check_world(world)?;
    if world == 1 {
        return Ok(());
    }
    let deadline = deadline_after(timeout);
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("making the rendezvous listener non-blocking", e))?;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut joined = 0;
    while joined < world - 1 {
        match accept_peer(&listener, world, &peers, deadline, timeout) {
            Accepted::Peer(rank, stream) => {
                peers[rank] = Some(stream);
                joined += 1;
            }
            Accepted::Nobody => match time_left(deadline) {
                Some(left) => thread::sleep(ACCEPT_POLL.min(left)),
                None => {
                    let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
                    let error = Error::Timeout {
                        what: format!("ranks {missing:?} to join the TCP rendezvous"),
                        after: timeout,
                    };
                    abort_peers(&peers, None, &error);
                    return Err(error);
                }
            },
            Accepted::Refused(error, offender) => {
                abort_peers(&peers, offender, &error);
                return Err(error);
            }
        }
    }

    let mut reply = Vec::with_capacity(TCP_MAGIC.len() + 1 + UNIQUE_ID_BYTES);
    reply.extend_from_slice(&TCP_MAGIC);
    reply.push(STATUS_OK);
    reply.extend_from_slice(id.as_bytes());
    let mut first_failure = None;
    for (rank, stream) in peers.iter().enumerate() {
        let Some(stream) = stream else { continue };
        if let Err(e) = write_reply(stream, &reply) {
            first_failure.get_or_insert(Error::Rendezvous {
                peer: format!("rank {rank}"),
                reason: format!("sending the unique id failed: {e}"),
            });
        }
    }
    first_failure.map_or(Ok(()), Err)
}

/// What one look for a new connection on rank 0 found.
enum Accepted {
    /// Nobody is waiting to connect.
    Nobody,
    /// A peer with a good hello, and its rank.
    Peer(usize, TcpStream),
    /// A failure, with the connection of the peer that broke the protocol (if one did), to
    /// send it the error.
    Refused(Error, Option<TcpStream>),
}

/// Accepts at most one connection and checks its hello.
fn accept_peer(
    listener: &TcpListener,
    world: usize,
    peers: &[Option<TcpStream>],
    deadline: Instant,
    timeout: Duration,
) -> Accepted {
    let (mut stream, addr) = match listener.accept() {
        Ok(accepted) => accepted,
        Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {
            return Accepted::Nobody
        }
        // The peer gave up before we took its connection; it will retry or time out.
        Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => return Accepted::Nobody,
        Err(e) => {
            return Accepted::Refused(Error::io("accepting a rendezvous connection", e), None)
        }
    };
    match read_hello(&mut stream, addr, world, peers, deadline, timeout) {
        Ok(rank) => Accepted::Peer(rank, stream),
        Err(error) => Accepted::Refused(error, Some(stream)),
    }
}

/// Reads and checks one hello; returns the peer's rank.
fn read_hello(
    stream: &mut TcpStream,
    addr: SocketAddr,
    world: usize,
    peers: &[Option<TcpStream>],
    deadline: Instant,
    timeout: Duration,
) -> Result<usize> {
    let garbage = |reason: String| Error::Rendezvous {
        peer: addr.to_string(),
        reason,
    };
    let timed_out = || Error::Timeout {
        what: format!("a hello from {addr}"),
        after: timeout,
    };
    let left = time_left(deadline).ok_or_else(timed_out)?;
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(left)))
        .map_err(|e| Error::io(format!("configuring the connection from {addr}"), e))?;

    let mut hello = [0u8; HELLO_BYTES];
    if let Err(e) = stream.read_exact(&mut hello) {
        return Err(if is_timeout(&e) {
            timed_out()
        } else {
            garbage(format!("reading its hello failed: {e}"))
        });
    }
    let (magic, numbers) = hello.split_at(TCP_MAGIC.len());
    if magic != TCP_MAGIC {
        return Err(garbage(format!(
            "not a tpfuse rendezvous hello (starts with {magic:02x?})"
        )));
    }
    let rank = u32_at(numbers, 0) as usize;
    let got = u32_at(numbers, 4) as usize;
    if got != world {
        return Err(Error::WorldSizeMismatch {
            expected: world,
            rank,
            got,
        });
    }
    if rank == 0 || rank >= world {
        return Err(Error::RankOutOfRange { rank, world });
    }
    if peers[rank].is_some() {
        return Err(Error::DuplicateRank(rank));
    }
    Ok(rank)
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

fn write_reply(mut stream: &TcpStream, reply: &[u8]) -> io::Result<()> {
    stream.set_write_timeout(Some(REPLY_WRITE_TIMEOUT))?;
    stream.write_all(reply)?;
    stream.flush()
}

/// Sends `error` to the offender and to every connected peer, best effort.
fn abort_peers(peers: &[Option<TcpStream>], offender: Option<TcpStream>, error: &Error) {
    let message = error.to_string();
    let length = message.len().min(MAX_MESSAGE_BYTES as usize);
    let mut reply = Vec::with_capacity(TCP_MAGIC.len() + 5 + length);
    reply.extend_from_slice(&TCP_MAGIC);
    reply.push(STATUS_ERROR);
    reply.extend_from_slice(&(length as u32).to_le_bytes());
    reply.extend_from_slice(&message.as_bytes()[..length]);
    for stream in peers.iter().flatten().chain(offender.as_ref()) {
        // A peer that is gone does not need the message.
        let _ = write_reply(stream, &reply);
    }
}

/// Fetches the unique id from rank 0's [`serve_tcp`] at `addr`, as rank `rank` of `world`
/// (the other ranks' side of the TCP rendezvous).
///
/// Connection attempts are retried, with pauses growing from 10 ms to 250 ms, until rank 0
/// listens or `timeout` passes; the whole exchange finishes within `timeout`.
///
/// # Errors
///
/// - [`Error::RankOutOfRange`] when `rank` is not in `1..world`.
/// - [`Error::Timeout`] when rank 0 could not be reached, or did not answer, in time.
/// - [`Error::Rendezvous`] when rank 0 reports a failure (its message is the reason) or
///   answers something that is not the tpfuse protocol.
pub fn join_tcp(
    addr: impl ToSocketAddrs,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<UniqueId> {
    if rank == 0 || rank >= world {
        return Err(Error::RankOutOfRange { rank, world });
    }
    let (Ok(wire_rank), Ok(wire_world)) = (u32::try_from(rank), u32::try_from(world)) else {
        return Err(Error::invalid(
            "world",
            format!("{world} does not fit in 32 bits"),
        ));
    };
    let deadline = deadline_after(timeout);
    let (mut stream, peer) = connect_until(&addr, deadline, timeout)?;
    let server = format!("rank 0 at {peer}");
    let timed_out = || Error::Timeout {
        what: format!("the unique id from {server}"),
        after: timeout,
    };
    let garbage = |reason: String| Error::Rendezvous {
        peer: server.clone(),
        reason,
    };
    let left = time_left(deadline).ok_or_else(timed_out)?;
    stream
        .set_read_timeout(Some(left))
        .and_then(|()| stream.set_write_timeout(Some(left)))
        .map_err(|e| Error::io(format!("configuring the connection to {server}"), e))?;

    let mut hello = [0u8; HELLO_BYTES];
    hello[..8].copy_from_slice(&TCP_MAGIC);
    hello[8..12].copy_from_slice(&wire_rank.to_le_bytes());
    hello[12..].copy_from_slice(&wire_world.to_le_bytes());
    stream
        .write_all(&hello)
        .map_err(|e| garbage(format!("sending the hello failed: {e}")))?;

    let mut read = |buf: &mut [u8]| -> Result<()> {
        stream.read_exact(buf).map_err(|e| {
            if is_timeout(&e) {
                timed_out()
            } else if e.kind() == io::ErrorKind::UnexpectedEof {
                garbage(String::from(
                    "connection closed before the reply was complete",
                ))
            } else {
                garbage(format!("reading the reply failed: {e}"))
            }
        })
    };
    let mut head = [0u8; 9];
    read(&mut head)?;
    if head[..8] != TCP_MAGIC {
        return Err(garbage(format!(
            "not a tpfuse rendezvous reply (starts with {:02x?})",
            &head[..8]
        )));
    }
    match head[8] {
        STATUS_OK => {
            let mut id = [0u8; UNIQUE_ID_BYTES];
            read(&mut id)?;
            Ok(UniqueId(id))
        }
        STATUS_ERROR => {
            let mut length = [0u8; 4];
            read(&mut length)?;
            let length = u32::from_le_bytes(length);
            if length > MAX_MESSAGE_BYTES {
                return Err(garbage(format!(
                    "error message of {length} bytes is too long"
                )));
            }
            let mut message = vec![0u8; length as usize];
            read(&mut message)?;
            Err(garbage(String::from_utf8_lossy(&message).into_owned()))
        }
        status => Err(garbage(format!("unknown reply status {status}"))),
    }
}

/// Connects to the first address of `addr` that accepts, retrying until `deadline`.
fn connect_until(
    addr: &impl ToSocketAddrs,
    deadline: Instant,
    timeout: Duration,
) -> Result<(TcpStream, SocketAddr)> {
    let mut pause = Duration::from_millis(10);
    let mut last_error = String::from("no attempt made");
    loop {
        match addr.to_socket_addrs() {
            Ok(candidates) => {
                for candidate in candidates {
                    let Some(left) = time_left(deadline) else {
                        break;
                    };
                    let attempt = left.min(Duration::from_secs(1));
                    match TcpStream::connect_timeout(&candidate, attempt) {
                        Ok(stream) => {
                            // Lower latency for the tiny messages; failure is harmless.
                            let _ = stream.set_nodelay(true);
                            return Ok((stream, candidate));
                        }
                        Err(e) => last_error = format!("{candidate}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("resolving the address: {e}"),
        }
        let Some(left) = time_left(deadline) else {
            return Err(Error::Timeout {
                what: format!(
                    "rank 0's TCP rendezvous to accept a connection (last error: {last_error})"
                ),
                after: timeout,
            });
        };
        thread::sleep(pause.min(left));
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}
