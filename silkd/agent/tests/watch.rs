//! watch against a real silkd: event kinds in order, recursion, overflow under a flood, the
//! root going away, and bad input.

mod common;

use std::path::Path;

use common::*;
use silk_proto::*;

fn watch(path: &Path, recursive: bool) -> Frame {
    Frame::Watch(WatchRequest { path: path_str(path), recursive })
}

async fn ready(c: &mut Client) {
    let f = c.recv().await;
    assert_eq!(f, Frame::Ready, "got {}", f.name());
}

/// Reads events until `done` holds for the events so far.
async fn events_until(
    c: &mut Client,
    mut done: impl FnMut(&[WatchEvent]) -> bool,
) -> Vec<WatchEvent> {
    let mut all = vec![];
    while !done(&all) {
        match c.recv().await {
            Frame::Events(batch) => all.extend(batch),
            other => panic!("expected Events, got {} after {} events", other.name(), all.len()),
        }
    }
    all
}

fn position(events: &[WatchEvent], kind: EventKind, path: &Path) -> usize {
    let path = path_str(path);
    events
        .iter()
        .position(|e| e.kind == kind && e.path == path)
        .unwrap_or_else(|| panic!("no {kind:?} {path} among {} events", events.len()))
}

#[tokio::test]
async fn create_modify_rename_delete_arrive_in_order() {
    let silkd = Silkd::start();
    let dir = silkd.path("w");
    std::fs::create_dir(&dir).unwrap();
    let mut c = silkd.connect().await;
    c.send(watch(&dir, false)).await;
    ready(&mut c).await;

    let (a, b) = (dir.join("a"), dir.join("b"));
    std::fs::File::create(&a).unwrap();
    std::fs::write(&a, "content").unwrap();
    std::fs::rename(&a, &b).unwrap();
    std::fs::remove_file(&b).unwrap();
    let sub = dir.join("sub");
    std::fs::create_dir(&sub).unwrap();

    let events =
        events_until(&mut c, |e| e.iter().any(|e| e.dir && e.kind == EventKind::Created)).await;
    let created = position(&events, EventKind::Created, &a);
    let modified = position(&events, EventKind::Modified, &a);
    let renamed = position(&events, EventKind::Renamed, &a);
    let deleted = position(&events, EventKind::Deleted, &b);
    assert!(created < modified && modified < renamed && renamed < deleted);
    assert_eq!(events[renamed].to.as_deref(), Some(path_str(&b).as_str()));
    assert!(!events[created].dir);

    // Not recursive: a file inside the new directory is not reported.
    std::fs::write(sub.join("inner"), "x").unwrap();
    std::fs::write(dir.join("marker"), "x").unwrap();
    let events = events_until(&mut c, |e| e.iter().any(|e| e.path.ends_with("/marker"))).await;
    assert!(events.iter().all(|e| !e.path.contains("inner")));

    c.send(Frame::Cancel).await;
    c.reply().await.done();
    c.call(Frame::Info).await.done();
}

#[tokio::test]
async fn recursive_watch_follows_new_and_moved_directories() {
    let silkd = Silkd::start();
    let dir = silkd.path("r");
    std::fs::create_dir_all(dir.join("old/nested")).unwrap();
    let mut c = silkd.connect().await;
    c.send(watch(&dir, true)).await;
    ready(&mut c).await;

    // Existing subdirectories are watched.
    let deep = dir.join("old/nested/file");
    std::fs::write(&deep, "x").unwrap();
    events_until(&mut c, |e| e.iter().any(|e| e.path == path_str(&deep))).await;

    // A tree made at once: every level is reported, even files made before its watch existed.
    let made = dir.join("new/a/b");
    std::fs::create_dir_all(&made).unwrap();
    std::fs::write(made.join("leaf"), "x").unwrap();
    let leaf = path_str(&made.join("leaf"));
    let events = events_until(&mut c, |e| e.iter().any(|e| e.path == leaf)).await;
    for p in ["new", "new/a", "new/a/b"] {
        let p = path_str(&dir.join(p));
        assert!(events.iter().any(|e| e.path == p && e.dir && e.kind == EventKind::Created), "{p}");
    }

    // A directory renamed inside the tree keeps reporting under its new name.
    std::fs::rename(dir.join("old"), dir.join("moved")).unwrap();
    let inside = dir.join("moved/nested/after");
    std::fs::write(&inside, "x").unwrap();
    let events = events_until(&mut c, |e| e.iter().any(|e| e.path == path_str(&inside))).await;
    let renamed = position(&events, EventKind::Renamed, &dir.join("old"));
    assert!(events[renamed].dir);

    // Deleting the root ends the call after reporting it.
    std::fs::remove_dir_all(&dir).unwrap();
    let r = c.reply().await;
    r.done();
    let events: Vec<WatchEvent> = r
        .frames
        .iter()
        .flat_map(|f| match f {
            Frame::Events(e) => e.clone(),
            other => panic!("unexpected {}", other.name()),
        })
        .collect();
    let last = events.last().expect("the root's deletion is reported");
    assert_eq!((last.kind, last.path.as_str()), (EventKind::Deleted, path_str(&dir).as_str()));
}

/// A client that does not keep up: the stream ends with an explicit overflow error, and what it
/// did receive is every event up to that point, in order (nothing skipped silently).
#[tokio::test]
async fn a_flood_ends_the_stream_with_an_overflow_error() {
    let silkd = Silkd::start_with(&["--watch-queue", "64"]);
    let dir = silkd.path("flood");
    std::fs::create_dir(&dir).unwrap();
    let mut c = silkd.connect().await;
    c.send(watch(&dir, false)).await;
    ready(&mut c).await;
    let names: Vec<String> = (0..30_000).map(|i| path_str(&dir.join(format!("f{i:05}")))).collect();
    for name in &names {
        std::fs::File::create(name).unwrap();
    }
    let r = c.reply().await;
    assert_eq!(r.error_kind(), Some(ErrorKind::ResourceExhausted));
    let created: Vec<String> = r
        .frames
        .iter()
        .flat_map(|f| match f {
            Frame::Events(e) => e.clone(),
            other => panic!("unexpected {}", other.name()),
        })
        .filter(|e| e.kind == EventKind::Created)
        .map(|e| e.path)
        .collect();
    assert!(created.len() < names.len());
    assert_eq!(created, names[..created.len()], "a gapless prefix of what happened");
    c.call(Frame::Info).await.done();
}

#[tokio::test]
async fn watching_one_file_and_bad_paths() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let r = c.call(watch(&silkd.path("missing"), true)).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));

    let file = silkd.path("one");
    std::fs::write(&file, "a").unwrap();
    c.send(watch(&file, false)).await;
    ready(&mut c).await;
    std::fs::write(&file, "b").unwrap();
    events_until(&mut c, |e| e.iter().any(|e| e.kind == EventKind::Modified)).await;
    std::fs::remove_file(&file).unwrap();
    let r = c.reply().await;
    r.done();
    assert!(r.frames.iter().any(|f| matches!(f, Frame::Events(e)
        if e.iter().any(|e| e.kind == EventKind::Deleted && e.path == path_str(&file)))));
}
