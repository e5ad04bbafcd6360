//! Tests of the claims journal: replay, group commit, torn tails, corruption, compaction, and
//! acknowledged commits surviving kill -9 of a writer process.

use super::*;

use serde::Deserialize;

use super::mutations::{OldRec, Rec};

fn rec(seq: u64) -> Rec {
    Rec { seq, note: format!("note-{seq}") }
}

/// Opens the journal in `dir`. A lock just released can still be held for a moment by a
/// child another test is spawning (a fork shares the lock's open file until its exec), so
/// `InUse` is waited out briefly.
fn open(dir: &Path) -> (Journal<Rec>, BTreeMap<String, Rec>) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        match Journal::open(dir, false) {
            Err(JournalError::InUse(_)) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            opened => return opened.expect("open journal"),
        }
    }
}

fn log_len(dir: &Path) -> u64 {
    fs::metadata(dir.join(LOG)).expect("stat log").len()
}

fn append_bytes(dir: &Path, bytes: &[u8]) {
    let mut f = OpenOptions::new().append(true).open(dir.join(LOG)).expect("open log");
    f.write_all(bytes).expect("append");
}

fn put(key: &str, seq: u64) -> Change<Rec> {
    Change::Put(key.to_string(), rec(seq))
}

#[tokio::test]
async fn put_delete_replay_round_trip() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (journal, live) = open(dir.path());
    assert!(live.is_empty());
    journal.commit(vec![put("a", 1), put("b", 2), put("c", 3)]).await.expect("commit");
    journal.commit(vec![Change::Delete("b".into()), put("a", 4)]).await.expect("commit");
    journal.commit(vec![Change::Delete("missing".into())]).await.expect("commit");
    journal.commit(vec![]).await.expect("empty commit");
    assert_eq!(journal.len(), 2);
    drop(journal);

    let (journal, live) = open(dir.path());
    let want: BTreeMap<_, _> = [("a".to_string(), rec(4)), ("c".to_string(), rec(3))].into();
    assert_eq!(live, want);
    assert_eq!(journal.len(), 2);
    // Appending after a replay extends the same log.
    journal.commit(vec![put("d", 5)]).await.expect("commit");
    drop(journal);
    let (_journal, live) = open(dir.path());
    assert_eq!(live.len(), 3);
    assert_eq!(live["d"], rec(5));
}

#[tokio::test]
async fn payload_is_postcard_of_the_batch() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (journal, _) = open(dir.path());
    journal.commit(vec![put("x", 7), Change::Delete("y".into())]).await.expect("commit");
    drop(journal);
    let bytes = fs::read(dir.path().join(LOG)).expect("read log");
    assert_eq!(bytes[..HEADER_LEN], header(Rec::VERSION));
    assert_eq!(bytes[..MAGIC_LEN], *b"SLKJRNL\0");
    assert_eq!(bytes[MAGIC_LEN..HEADER_LEN], 2u32.to_le_bytes());
    let frame = &bytes[HEADER_LEN..];
    let len = u32::from_le_bytes(frame[..4].try_into().expect("4 bytes")) as usize;
    let payload = &frame[FRAME_HEADER..];
    assert_eq!(payload.len(), len);
    assert_eq!(frame[4..8], blake3::hash(payload).as_bytes()[..4]);
    let batch: Vec<(String, Option<Rec>)> = vec![("x".into(), Some(rec(7))), ("y".into(), None)];
    assert_eq!(payload, postcard::to_allocvec(&batch).expect("encode"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_commits_are_all_acknowledged_and_kept() {
    // fsync on: the group-commit thread, where slow writes make batches queue up behind each
    // other; off: each caller appends under the writer's mutex.
    for fsync in [true, false] {
        concurrent_commits(fsync).await;
    }
}

async fn concurrent_commits(fsync: bool) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (journal, _) = Journal::<Rec>::open(dir.path(), fsync).expect("open");
    let journal = Arc::new(journal);
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let journal = journal.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..25u64 {
                let key = format!("t{t}-{i}");
                journal.commit(vec![Change::Put(key, rec(t * 100 + i))]).await?;
            }
            Ok::<_, JournalError>(())
        }));
    }
    for task in tasks {
        task.await.expect("task").expect("commits");
    }
    assert_eq!(journal.len(), 200);
    drop(Arc::into_inner(journal).expect("sole owner"));

    let (_journal, live) = open(dir.path());
    assert_eq!(live.len(), 200);
    for t in 0..8u64 {
        for i in 0..25u64 {
            assert_eq!(live[&format!("t{t}-{i}")], rec(t * 100 + i));
        }
    }
}

#[tokio::test]
async fn torn_tail_is_truncated() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (journal, _) = open(dir.path());
    journal.commit(vec![put("a", 1)]).await.expect("commit");
    let good = log_len(dir.path());
    journal.commit(vec![put("b", 2)]).await.expect("commit");
    drop(journal);

    // A last batch cut short.
    let file = OpenOptions::new().write(true).open(dir.path().join(LOG)).expect("open");
    file.set_len(log_len(dir.path()) - 3).expect("truncate");
    drop(file);
    let (journal, live) = open(dir.path());
    assert_eq!(live.keys().collect::<Vec<_>>(), ["a"]);
    assert_eq!(log_len(dir.path()), good);
    journal.commit(vec![put("c", 3)]).await.expect("commit after trim");
    drop(journal);
    let good = log_len(dir.path());

    // Garbage: an in-bounds length whose checksum does not match, then zeros (what a power
    // cut can leave in blocks the size update reached first).
    let mut garbage = 6u32.to_le_bytes().to_vec();
    garbage.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6]);
    garbage.extend_from_slice(&[0; 100]);
    append_bytes(dir.path(), &garbage);
    let (journal, live) = open(dir.path());
    assert_eq!(live.keys().collect::<Vec<_>>(), ["a", "c"]);
    assert_eq!(log_len(dir.path()), good);
    drop(journal);

    // A lone partial frame header.
    append_bytes(dir.path(), &[0xff; 5]);
    let (_journal, live) = open(dir.path());
    assert_eq!(live.len(), 2);
    assert_eq!(log_len(dir.path()), good);
}

#[tokio::test]
async fn damage_before_good_batches_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (journal, _) = open(dir.path());
    for i in 0..3 {
        journal.commit(vec![put(&format!("k{i}"), i)]).await.expect("commit");
    }
    drop(journal);
    let path = dir.path().join(LOG);
    let pristine = fs::read(&path).expect("read");

    // A flipped payload byte in the first batch, then a length that runs past the end.
    for at in [HEADER_LEN + FRAME_HEADER + 2, HEADER_LEN + 2] {
        let mut bytes = pristine.clone();
        bytes[at] ^= 0x40;
        fs::write(&path, &bytes).expect("write");
        match Journal::<Rec>::open(dir.path(), false) {
            Err(JournalError::Corrupt { offset, .. }) => assert_eq!(offset, HEADER_LEN as u64),
            other => panic!("expected corruption, got {other:?}"),
        }
        // Nothing was truncated.
        assert_eq!(fs::read(&path).expect("read"), bytes);
    }

    fs::write(&path, b"not a journal at all").expect("write");
    assert!(matches!(
        Journal::<Rec>::open(dir.path(), false),
        Err(JournalError::Corrupt { offset: 0, .. })
    ));
}

#[tokio::test]
async fn compaction_bounds_the_log_and_keeps_the_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (journal, _) = open(dir.path());
    let pad = "x".repeat(4096);
    let mut written = 0;
    for i in 0..1000u64 {
        let key = format!("hot-{}", i % 8);
        let value = Rec { seq: i, note: format!("{i}-{pad}") };
        journal.commit(vec![Change::Put(key, value)]).await.expect("commit");
        written += 4096;
    }
    journal.commit(vec![put("cold", 1)]).await.expect("commit");
    assert_eq!(journal.len(), 9);
    drop(journal);
    let len = log_len(dir.path());
    assert!(len <= COMPACT_FLOOR + 8192, "log is {len} bytes after {written} written");
    assert!(!dir.path().join(TMP).exists());

    let (_journal, live) = open(dir.path());
    assert_eq!(live.len(), 9);
    assert_eq!(live["cold"], rec(1));
    for k in 0..8u64 {
        let last = 992 + k;
        assert_eq!(live[&format!("hot-{k}")], Rec { seq: last, note: format!("{last}-{pad}") });
    }
}

#[tokio::test]
async fn second_open_is_refused_and_stale_tmp_removed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (journal, _) = open(dir.path());
    assert!(matches!(Journal::<Rec>::open(dir.path(), false), Err(JournalError::InUse(_))));
    journal.commit(vec![put("a", 1)]).await.expect("commit");
    drop(journal);
    // What a kill during compaction leaves: the old log whole, a partial image beside it.
    fs::write(dir.path().join(TMP), b"half a compaction").expect("write tmp");
    let (_journal, live) = open(dir.path());
    assert_eq!(live.keys().collect::<Vec<_>>(), ["a"]);
    assert!(!dir.path().join(TMP).exists());
}

/// Set in the child process that `crash_writer_child` turns into a writer.
const CRASH_DIR: &str = "SILKMESH_JOURNAL_CRASH_DIR";
/// Acknowledged records the parent waits for before killing the child: enough for the
/// records' padding to push the log through a few compactions.
const CRASH_ACKS: u64 = 600;

/// Not a test on its own: with `CRASH_DIR` set it commits records until killed, printing
/// `acked <seq>` once each commit returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_writer_child() {
    let Some(dir) = std::env::var_os(CRASH_DIR) else {
        return;
    };
    let (journal, _) = Journal::<Rec>::open(Path::new(&dir), false).expect("child open");
    let pad = "p".repeat(4096);
    let mut out = io::stdout().lock();
    for seq in 0..100 * CRASH_ACKS {
        let changes = vec![
            Change::Put(format!("seq-{seq}"), rec(seq)),
            Change::Put(format!("hot-{}", seq % 16), Rec { seq, note: pad.clone() }),
        ];
        journal.commit(changes).await.expect("child commit");
        // Straight to fd 1: the test harness captures `println!`, not the stdout handle.
        if writeln!(out, "acked {seq}").and_then(|()| out.flush()).is_err() {
            return; // the parent is gone
        }
    }
}

#[test]
fn acknowledged_commits_survive_kill_9() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};

    let dir = tempfile::tempdir().expect("tempdir");
    let exe = std::env::current_exe().expect("current exe");
    let mut child = Command::new(exe)
        .args(["crash_writer_child", "--nocapture", "--test-threads=1"])
        .env(CRASH_DIR, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn child");
    let stdout = child.stdout.take().expect("child stdout");
    let mut lines = io::BufReader::new(stdout).lines();
    let mut acked = Vec::new();
    let parse = |line: String| line.strip_prefix("acked ").map(|s| s.parse::<u64>().expect("seq"));
    while (acked.len() as u64) < CRASH_ACKS {
        let line = lines.next().expect("child exited early").expect("read child");
        acked.extend(parse(line));
    }
    child.kill().expect("kill -9");
    child.wait().expect("reap child");
    // Lines the child printed before it died were acknowledged too.
    for line in lines {
        acked.extend(parse(line.expect("read child")));
    }

    let (_journal, live) = open(dir.path());
    for &seq in &acked {
        assert_eq!(live.get(&format!("seq-{seq}")), Some(&rec(seq)), "acked seq {seq} lost");
    }
    let last = *acked.last().expect("some acks");
    for k in 0..16 {
        // The newest acknowledged write to each hot key, or one after it.
        let newest = (0..=last).rev().find(|s| s % 16 == k).expect("every hot key written");
        assert!(live[&format!("hot-{k}")].seq >= newest, "hot-{k} went back in time");
    }
}

/// `Digest` became a checked string (`#[serde(try_from = "String", into = "String")]`) where it
/// was a plain newtype. Postcard writes both as the bare string: journals written before read
/// the same, and old builds could read what this one writes. A claim record with a hibernated
/// snapshot (template and golden digests inside) goes through a real journal.
#[tokio::test]
async fn digests_keep_their_journal_encoding() {
    use crate::claims::{ClaimRecord, Intent, OnExpire, Tier};
    use silk_engine::{Base, BoxSpec, Digest, Golden, Lane, Size, Snapshot, Template};

    #[derive(Serialize, Deserialize)]
    struct OldDigest(String);
    let hex = "0f".repeat(32);
    let digest: Digest = hex.parse().expect("a digest");
    let old = postcard::to_allocvec(&OldDigest(hex.clone())).expect("encode");
    assert_eq!(postcard::to_allocvec(&digest).expect("encode"), old, "the same bytes");
    assert_eq!(postcard::from_bytes::<Digest>(&old).expect("decode"), digest, "old bytes read");
    let bad = postcard::to_allocvec(&OldDigest("../../x".into())).expect("encode");
    assert!(postcard::from_bytes::<Digest>(&bad).is_err(), "a bad digest is refused");

    let template = Template {
        name: "host".into(),
        digest: digest.clone(),
        root: "/t".into(),
        binds: vec![],
        env: vec![],
        cwd: None,
        user: None,
    };
    let golden =
        Golden { digest: "ab".repeat(32).parse().expect("a digest"), template, layer: "/g".into() };
    let snap = Snapshot {
        base: Base { template: golden.template.clone(), golden: Some(golden) },
        spec: BoxSpec::new(Size::Small, Lane::None),
        layer_tar: "/s.tar".into(),
        bytes: 3,
        memory: false,
        memory_why_not: None,
        freeze_ms: None,
        vouched: false,
    };
    let record = ClaimRecord {
        id: "sb-1".into(),
        token_hash: "h".into(),
        template: "host".into(),
        size: Size::Small,
        lane: Lane::None,
        tier: Tier::Warm,
        phase: crate::claims::Phase::Captured(Box::new(snap.clone())),
        created_ms: 1,
        deadline_ms: 2,
        on_expire: OnExpire::Archive,
        metadata: BTreeMap::new(),
        lease_seconds: 3,
        idle_hibernate_seconds: None,
        from_checkpoint: None,
        forked_from: None,
        state_since_ms: 4,
        intent: Some(Intent::Hibernate(Box::new(snap))),
        tenant: Some("team-a".into()),
        egress: Some(silk_api::EgressPolicy { allow: vec!["pypi.org".into()], deny: vec![] }),
        previews: vec![crate::previews::Grant { hash: "ab".repeat(32), port: 8080, expires_ms: 5 }],
    };
    let dir = tempfile::tempdir().expect("tempdir");
    type Stored = crate::stored::StoredClaim;
    let (journal, _) = Journal::<Stored>::open(dir.path(), false).expect("open");
    journal.commit(vec![Change::Put("sb-1".into(), Stored::from(&record))]).await.expect("commit");
    drop(journal);
    let (_journal, live) = Journal::<Stored>::open(dir.path(), false).expect("reopen");
    let live = crate::stored::live_records(live).expect("records");
    assert_eq!(live["sb-1"], record);
}

/// A log in format `version` holding one batch of `records`.
fn log_of<R: Serialize>(version: u32, records: &[(&str, Option<R>)]) -> Vec<u8> {
    let payload = postcard::to_allocvec(records).expect("encode");
    let mut log = header(version).to_vec();
    log.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    log.extend_from_slice(&checksum(&payload));
    log.extend_from_slice(&payload);
    log
}

#[tokio::test]
async fn a_log_one_version_older_is_upgraded_and_rewritten_others_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let old = [("a", Some(OldRec { seq: 1 })), ("b", Some(OldRec { seq: 2 })), ("b", None)];
    fs::write(dir.path().join(LOG), log_of(1, &old)).expect("write");
    let (journal, live) = open(dir.path());
    let want: BTreeMap<_, _> = [("a".to_string(), Rec { seq: 1, note: "upgraded".into() })].into();
    assert_eq!(live, want);
    // Rewritten in the current version before anything is appended to it.
    assert_eq!(fs::read(dir.path().join(LOG)).expect("read")[..HEADER_LEN], header(Rec::VERSION));
    journal.commit(vec![put("c", 3)]).await.expect("commit");
    drop(journal);
    let (_journal, live) = open(dir.path());
    assert_eq!(live.keys().collect::<Vec<_>>(), ["a", "c"]);
    drop(_journal);

    for version in [0, 3] {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join(LOG), log_of(version, &[("a", Some(rec(1)))])).expect("write");
        let err = Journal::<Rec>::open(dir.path(), false).expect_err("another version");
        assert!(err.to_string().contains(&format!("format version {version}")), "{err}");
    }
}
