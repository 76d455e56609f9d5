//! The TCP rendezvous: rank 0 listens, the other ranks connect and get the id.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use super::{check_world, deadline_after, time_left};
use crate::comm::unique_id::{UniqueId, UNIQUE_ID_BYTES};
use crate::error::{Error, Result};

// Protocol (all integers little-endian):
//
//   peer -> rank 0   hello:  b"TPFUSE02", u32 rank, u32 world, u32 n, n bytes of run id (UTF-8)
//   rank 0 -> peer   reply:  b"TPFUSE02", u8 status, then
//                            status 0: the 128 bytes of the unique id
//                            status 1: u32 length, that many bytes of UTF-8 error message
//
// The run id names the job (LaunchEnv::run_id; empty when there is none, and then only the
// world size tells two jobs apart). Two jobs started on one node with the same address and
// port must never mix: the second job's rank 0 cannot bind, and its other ranks reach the
// first job's rank 0.
//
// Rank 0 accepts connections until ranks 1..world of its run have each said hello once,
// then sends every one of them the id. Connections are read concurrently: each accepted
// connection gets a thread that reads its hello under a short deadline (HELLO_TIMEOUT) and
// hands the result to rank 0's loop through a channel, so a connection that never speaks
// holds up nobody. Rank 0's loop then decides:
//
// - not a hello (a port scan, a health check, an HTTP request, silence, a hang-up): dropped
//   with a log line on stderr; the rendezvous goes on;
// - a hello of another run id: turned away with an error reply naming both runs; the
//   rendezvous goes on;
// - a hello of this run with another world size, a rank outside 1..world or a rank already
//   seen: this job is misconfigured, so the rendezvous is aborted: the offender and every
//   peer already waiting get an error reply (nobody waits for the timeout).
//
// Each side closes its connection after the reply.

const TCP_MAGIC: [u8; 8] = *b"TPFUSE02";
/// Magic, rank, world and the run id's length.
const HELLO_HEAD_BYTES: usize = 20;
/// The longest run id a hello may carry.
const MAX_RUN_ID_BYTES: usize = 1024;
const STATUS_OK: u8 = 0;
const STATUS_ERROR: u8 = 1;
/// The longest error message a peer accepts.
const MAX_MESSAGE_BYTES: u32 = 64 * 1024;
/// How long a reply may take to write; replies are small, so this only matters for a peer
/// that stopped reading.
const REPLY_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long rank 0 waits for the hello of one connection. Real ranks send it as soon as
/// they are connected; this bounds the thread that reads a connection that never speaks.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// The pause between two looks for a new connection on rank 0.
const ACCEPT_POLL: Duration = Duration::from_millis(5);

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn check_run_id(run_id: &str) -> Result<()> {
    if run_id.len() > MAX_RUN_ID_BYTES {
        return Err(Error::invalid(
            "run_id",
            format!(
                "{} bytes, at most {MAX_RUN_ID_BYTES} fit in a hello",
                run_id.len()
            ),
        ));
    }
    Ok(())
}

/// Serves `id` to ranks `1..world` of run `run_id` on `listener_addr` (rank 0's side of the
/// TCP rendezvous).
///
/// Binds a listener and runs [`serve_tcp_on`]. With `world == 1` there is nobody to serve:
/// it returns at once without binding.
///
/// # Errors
///
/// [`Error::RendezvousListen`] (naming the address) when the address cannot be bound,
/// otherwise as [`serve_tcp_on`].
pub fn serve_tcp(
    listener_addr: impl ToSocketAddrs,
    run_id: &str,
    world: usize,
    id: &UniqueId,
    timeout: Duration,
) -> Result<()> {
    check_world(world)?;
    check_run_id(run_id)?;
    if world == 1 {
        return Ok(());
    }
    let listener = bind_listener(
        listener_addr,
        "is another process listening there (another job, or another process of this job \
         that believes it is rank 0)? When tpfuse chooses the port from the launcher's \
         environment it is MASTER_PORT + 1; TPFUSE_MASTER_PORT overrides it",
    )?;
    serve_tcp_on(listener, run_id, world, id, timeout)
}

/// Binds the first address of `addr` that can be bound; the error names the last address
/// tried and gives `advice`.
pub(crate) fn bind_listener(addr: impl ToSocketAddrs, advice: &str) -> Result<TcpListener> {
    let candidates = addr
        .to_socket_addrs()
        .map_err(|source| Error::RendezvousListen {
            addr: String::from("(an address that does not resolve)"),
            advice: advice.to_owned(),
            source,
        })?;
    let mut failure = None;
    for candidate in candidates {
        match TcpListener::bind(candidate) {
            Ok(listener) => return Ok(listener),
            Err(source) => failure = Some((candidate, source)),
        }
    }
    let (addr, source) = failure.map_or_else(
        || {
            (
                String::from("(no address)"),
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "the address resolves to nothing",
                ),
            )
        },
        |(addr, source)| (addr.to_string(), source),
    );
    Err(Error::RendezvousListen {
        addr,
        advice: advice.to_owned(),
        source,
    })
}

/// Serves `id` to ranks `1..world` of run `run_id` on an already bound `listener`, returning
/// once every one of them has received it.
///
/// Connections are accepted, and their hellos read concurrently, until each of ranks
/// `1..world` of this run has said hello once, all within `timeout`; then each gets the id.
/// A connection that is not a tpfuse hello is dropped with a line on stderr, and a peer of
/// another run (another job on the same port) is turned away with an error naming both runs;
/// neither disturbs the rendezvous. A peer of this run that breaks the protocol aborts the
/// rendezvous for everybody: the offender and every peer already connected get an error
/// reply.
///
/// # Errors
///
/// - [`Error::WorldSizeMismatch`] for a peer of this run with another world size.
/// - [`Error::RankOutOfRange`] for a peer of this run whose rank is not in `1..world`.
/// - [`Error::DuplicateRank`] for a second peer of this run with the same rank.
/// - [`Error::Timeout`] when some ranks have not said hello within `timeout`; the text
///   lists them.
/// - [`Error::Rendezvous`] when the id cannot be sent to a peer.
/// - [`Error::Io`] when the listener fails; [`Error::InvalidArgument`] for `world == 0` or
///   a run id longer than 1024 bytes.
pub fn serve_tcp_on(
    listener: TcpListener,
    run_id: &str,
    world: usize,
    id: &UniqueId,
    timeout: Duration,
) -> Result<()> {
    check_world(world)?;
    check_run_id(run_id)?;
    if world == 1 {
        return Ok(());
    }
    let deadline = deadline_after(timeout);
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io("making the rendezvous listener non-blocking", e))?;
    let (hellos_to, hellos) = mpsc::channel::<Arrival>();
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut joined = 0;
    while joined < world - 1 {
        if let Err(error) = accept_all(&listener, &hellos_to, deadline) {
            abort_peers(&peers, None, &error);
            return Err(error);
        }
        let Some(left) = time_left(deadline) else {
            let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
            let error = Error::Timeout {
                what: format!("ranks {missing:?} to join the TCP rendezvous of run {run_id:?}"),
                after: timeout,
            };
            abort_peers(&peers, None, &error);
            return Err(error);
        };
        let arrival = match hellos.recv_timeout(ACCEPT_POLL.min(left)) {
            Ok(arrival) => arrival,
            Err(_) => continue,
        };
        let hello = match arrival.hello {
            Ok(hello) => hello,
            Err(reason) => {
                eprintln!(
                    "tpfuse: the TCP rendezvous of run {run_id:?} ignored a connection from {}: {reason}",
                    arrival.addr
                );
                continue;
            }
        };
        if hello.run_id != run_id {
            let message = format!(
                "this is the TCP rendezvous of run {run_id:?} ({world} ranks), but this rank is of run {:?} \
                 ({} ranks): two jobs use the same address and port; give each job its own MASTER_PORT \
                 (or TPFUSE_MASTER_PORT)",
                hello.run_id, hello.world
            );
            eprintln!(
                "tpfuse: the TCP rendezvous of run {run_id:?} turned away rank {} of run {:?} from {}",
                hello.rank, hello.run_id, arrival.addr
            );
            let _ = write_reply(&arrival.stream, &error_reply(&message));
            continue;
        }
        if let Err(error) = check_hello(&hello, world, &peers) {
            abort_peers(&peers, Some(arrival.stream), &error);
            return Err(error);
        }
        peers[hello.rank] = Some(arrival.stream);
        joined += 1;
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

/// A hello as read from the wire.
struct Hello {
    rank: usize,
    world: usize,
    run_id: String,
}

/// A connection whose hello has been read (or has failed to be).
struct Arrival {
    stream: TcpStream,
    addr: SocketAddr,
    /// The hello, or why the connection is not a tpfuse peer.
    hello: std::result::Result<Hello, String>,
}

/// Accepts every connection waiting on `listener` and starts reading its hello on a thread
/// of its own, which sends the result to `hellos`.
fn accept_all(
    listener: &TcpListener,
    hellos: &mpsc::Sender<Arrival>,
    deadline: Instant,
) -> Result<()> {
    loop {
        let (stream, addr) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            // The peer gave up before we took its connection; it will retry or time out.
            Err(e) if e.kind() == io::ErrorKind::ConnectionAborted => continue,
            Err(e) => return Err(Error::io("accepting a rendezvous connection", e)),
        };
        let hellos = hellos.clone();
        let limit = time_left(deadline).map_or(HELLO_TIMEOUT, |left| left.min(HELLO_TIMEOUT));
        thread::spawn(move || {
            let mut stream = stream;
            let hello = read_hello(&mut stream, limit);
            // Rank 0 may be gone already; then nobody needs this connection.
            let _ = hellos.send(Arrival {
                stream,
                addr,
                hello,
            });
        });
    }
}

/// Reads one hello within `limit`; the error says why the connection is not a tpfuse peer.
fn read_hello(stream: &mut TcpStream, limit: Duration) -> std::result::Result<Hello, String> {
    stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(Some(limit.max(Duration::from_millis(1)))))
        .map_err(|e| format!("configuring the connection failed: {e}"))?;
    let describe = |e: io::Error| {
        if is_timeout(&e) {
            format!("no hello within {limit:?}")
        } else if e.kind() == io::ErrorKind::UnexpectedEof {
            String::from("closed before a complete hello")
        } else {
            format!("reading its hello failed: {e}")
        }
    };
    // The magic first: a stranger that sent fewer bytes than a hello is told apart at once.
    let mut head = [0u8; HELLO_HEAD_BYTES];
    let (magic, numbers) = head.split_at_mut(TCP_MAGIC.len());
    stream.read_exact(magic).map_err(describe)?;
    if *magic != TCP_MAGIC {
        return Err(format!(
            "not a tpfuse rendezvous hello (starts with {magic:02x?}; this rank 0 speaks {:?})",
            String::from_utf8_lossy(&TCP_MAGIC)
        ));
    }
    stream.read_exact(numbers).map_err(describe)?;
    let rank = u32_at(numbers, 0) as usize;
    let world = u32_at(numbers, 4) as usize;
    let length = u32_at(numbers, 8) as usize;
    if length > MAX_RUN_ID_BYTES {
        return Err(format!("a run id of {length} bytes is too long"));
    }
    let mut run_id = vec![0u8; length];
    stream.read_exact(&mut run_id).map_err(describe)?;
    let run_id =
        String::from_utf8(run_id).map_err(|_| String::from("a run id that is not UTF-8"))?;
    Ok(Hello {
        rank,
        world,
        run_id,
    })
}

/// Checks the hello of a peer of this run against the world and the ranks already seen.
fn check_hello(hello: &Hello, world: usize, peers: &[Option<TcpStream>]) -> Result<()> {
    if hello.world != world {
        return Err(Error::WorldSizeMismatch {
            expected: world,
            rank: hello.rank,
            got: hello.world,
        });
    }
    if hello.rank == 0 || hello.rank >= world {
        return Err(Error::RankOutOfRange {
            rank: hello.rank,
            world,
        });
    }
    if peers[hello.rank].is_some() {
        return Err(Error::DuplicateRank(hello.rank));
    }
    Ok(())
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

/// The error reply carrying `message` (cut to [`MAX_MESSAGE_BYTES`]).
fn error_reply(message: &str) -> Vec<u8> {
    let mut length = message.len().min(MAX_MESSAGE_BYTES as usize);
    while !message.is_char_boundary(length) {
        length -= 1;
    }
    let mut reply = Vec::with_capacity(TCP_MAGIC.len() + 5 + length);
    reply.extend_from_slice(&TCP_MAGIC);
    reply.push(STATUS_ERROR);
    reply.extend_from_slice(&(length as u32).to_le_bytes());
    reply.extend_from_slice(&message.as_bytes()[..length]);
    reply
}

/// Sends `error` to the offender and to every connected peer, best effort.
fn abort_peers(peers: &[Option<TcpStream>], offender: Option<TcpStream>, error: &Error) {
    let reply = error_reply(&error.to_string());
    for stream in peers.iter().flatten().chain(offender.as_ref()) {
        // A peer that is gone does not need the message.
        let _ = write_reply(stream, &reply);
    }
}

/// Fetches the unique id from rank 0's [`serve_tcp`] at `addr`, as rank `rank` of `world`
/// in run `run_id` (the other ranks' side of the TCP rendezvous).
///
/// `run_id` names the job, the same on every rank ([`LaunchEnv::run_id`](super::LaunchEnv::run_id),
/// or empty when there is none): rank 0 turns away a peer of another run, so that two jobs on
/// one address and port never mix.
///
/// Connection attempts are retried, with pauses growing from 10 ms to 250 ms, until rank 0
/// listens or `timeout` passes; the whole exchange finishes within `timeout`.
///
/// # Errors
///
/// - [`Error::RankOutOfRange`] when `rank` is not in `1..world`.
/// - [`Error::Timeout`] when rank 0 could not be reached, or did not answer, in time.
/// - [`Error::Rendezvous`] when rank 0 reports a failure (its message is the reason: for
///   example that it serves another run) or answers something that is not the tpfuse
///   protocol.
/// - [`Error::InvalidArgument`] for a run id longer than 1024 bytes.
pub fn join_tcp(
    addr: impl ToSocketAddrs,
    run_id: &str,
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
    check_run_id(run_id)?;
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

    let mut hello = Vec::with_capacity(HELLO_HEAD_BYTES + run_id.len());
    hello.extend_from_slice(&TCP_MAGIC);
    hello.extend_from_slice(&wire_rank.to_le_bytes());
    hello.extend_from_slice(&wire_world.to_le_bytes());
    // check_run_id keeps the length far below u32::MAX.
    hello.extend_from_slice(&(run_id.len() as u32).to_le_bytes());
    hello.extend_from_slice(run_id.as_bytes());
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
