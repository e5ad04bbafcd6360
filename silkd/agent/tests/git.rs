//! git against a real silkd and the real git binary: status/add/commit/branch on a repository
//! in a tempdir, clone and push over `file://`, credentials over http (in memory only), and
//! typed errors.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use common::*;
use silk_proto::*;

fn git(repo: &Path, op: GitOp) -> Frame {
    Frame::Git(GitRequest { repo: path_str(repo), op, user: None, credentials: None })
}

fn host_git(dir: &Path, args: &[&str]) -> String {
    let out = std::process::Command::new("git").arg("-C").arg(dir).args(args).output().unwrap();
    assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn status_of(r: &Reply) -> GitStatus {
    r.done();
    match &r.frames[..] {
        [Frame::GitReply(GitReply::Status(s))] => s.clone(),
        _ => panic!("expected a status reply, got {} frames", r.frames.len()),
    }
}

fn branches_of(r: &Reply) -> Vec<GitBranch> {
    r.done();
    match &r.frames[..] {
        [Frame::GitReply(GitReply::Branches(b))] => b.clone(),
        _ => panic!("expected a branch list, got {} frames", r.frames.len()),
    }
}

fn author() -> Option<GitAuthor> {
    Some(GitAuthor { name: "Silk Test".into(), email: "silk@example.invalid".into() })
}

async fn commit(c: &mut Client, repo: &Path, message: &str) -> String {
    let r = c.call(git(repo, GitOp::Commit { message: message.into(), author: author() })).await;
    r.done();
    match &r.frames[..] {
        [Frame::GitReply(GitReply::Committed { oid })] => oid.clone(),
        _ => panic!("expected Committed"),
    }
}

#[tokio::test]
async fn status_add_commit_and_branches_on_a_real_repository() {
    let silkd = Silkd::start();
    let repo = silkd.path("repo");
    std::fs::create_dir(&repo).unwrap();
    host_git(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("a.txt"), "a\n").unwrap();
    std::fs::write(repo.join("b.txt"), "b\n").unwrap();
    let mut c = silkd.connect().await;

    let s = status_of(&c.call(git(&repo, GitOp::Status { limit: None })).await);
    assert_eq!((s.branch.as_deref(), s.oid.as_deref()), (Some("main"), None));
    assert_eq!(s.files.len(), 2);
    assert!(s.files.iter().all(|f| (f.staged, f.unstaged) == ('?', '?')));

    c.call(git(&repo, GitOp::Add { paths: vec!["a.txt".into()] })).await.done();
    let s = status_of(&c.call(git(&repo, GitOp::Status { limit: None })).await);
    let a = s.files.iter().find(|f| f.path == "a.txt").unwrap();
    assert_eq!((a.staged, a.unstaged), ('A', '.'));

    c.call(git(&repo, GitOp::Add { paths: vec![] })).await.done();
    let oid = commit(&mut c, &repo, "first").await;
    assert_eq!(oid.len(), 40);
    assert_eq!(
        host_git(&repo, &["log", "-1", "--format=%H %an %s"]),
        format!("{oid} Silk Test first\n")
    );
    let s = status_of(&c.call(git(&repo, GitOp::Status { limit: None })).await);
    assert_eq!((s.oid.as_deref(), s.files.len()), (Some(oid.as_str()), 0));

    // Staged and unstaged state on one file; the limit truncates.
    std::fs::write(repo.join("a.txt"), "a2\n").unwrap();
    c.call(git(&repo, GitOp::Add { paths: vec!["a.txt".into()] })).await.done();
    std::fs::write(repo.join("a.txt"), "a3\n").unwrap();
    for i in 0..5 {
        std::fs::write(repo.join(format!("new{i}")), "n").unwrap();
    }
    let s = status_of(&c.call(git(&repo, GitOp::Status { limit: Some(3) })).await);
    assert!(s.truncated);
    assert_eq!(s.files.len(), 3);
    let a = s.files.iter().find(|f| f.path == "a.txt").unwrap();
    assert_eq!((a.staged, a.unstaged), ('M', 'M'));

    // Branches: create, list, checkout, delete.
    c.call(git(&repo, GitOp::BranchCreate { name: "dev".into(), start: None })).await.done();
    let b = branches_of(&c.call(git(&repo, GitOp::BranchList)).await);
    let names: Vec<(&str, bool)> = b.iter().map(|b| (b.name.as_str(), b.current)).collect();
    assert_eq!(names, vec![("dev", false), ("main", true)]);
    assert!(b.iter().all(|b| b.oid == oid));
    c.call(git(&repo, GitOp::Checkout { branch: "dev".into() })).await.done();
    let s = status_of(&c.call(git(&repo, GitOp::Status { limit: None })).await);
    assert_eq!(s.branch.as_deref(), Some("dev"));
    let r = c.call(git(&repo, GitOp::BranchDelete { name: "dev".into(), force: false })).await;
    assert!(r.error_kind().is_some(), "the current branch cannot be deleted");
    c.call(git(&repo, GitOp::Checkout { branch: "main".into() })).await.done();
    c.call(git(&repo, GitOp::BranchDelete { name: "dev".into(), force: false })).await.done();
    assert_eq!(branches_of(&c.call(git(&repo, GitOp::BranchList)).await).len(), 1);
}

#[tokio::test]
async fn clone_commit_and_push_over_file_urls() {
    let silkd = Silkd::start();
    let (origin, bare, work) = (silkd.path("origin"), silkd.path("bare.git"), silkd.path("work"));
    std::fs::create_dir(&origin).unwrap();
    host_git(&origin, &["init", "-q", "-b", "main"]);
    std::fs::write(origin.join("readme"), "hi\n").unwrap();
    host_git(&origin, &["add", "."]);
    host_git(&origin, &["-c", "user.name=o", "-c", "user.email=o@o", "commit", "-qm", "init"]);
    host_git(silkd.dir.path(), &["clone", "-q", "--bare", &path_str(&origin), &path_str(&bare)]);

    let mut c = silkd.connect().await;
    let url = format!("file://{}", path_str(&bare));
    c.call(git(&work, GitOp::Clone { url: url.clone(), branch: None })).await.done();
    assert_eq!(std::fs::read_to_string(work.join("readme")).unwrap(), "hi\n");
    let s = status_of(&c.call(git(&work, GitOp::Status { limit: None })).await);
    assert_eq!(s.upstream.as_deref(), Some("origin/main"));

    std::fs::write(work.join("more"), "x\n").unwrap();
    c.call(git(&work, GitOp::Add { paths: vec![] })).await.done();
    let oid = commit(&mut c, &work, "more").await;
    let s = status_of(&c.call(git(&work, GitOp::Status { limit: None })).await);
    assert_eq!((s.ahead, s.behind), (1, 0));
    let push = GitOp::Push { remote: None, branch: None, set_upstream: false };
    c.call(git(&work, push)).await.done();
    assert_eq!(host_git(&bare, &["rev-parse", "main"]).trim(), oid);

    // Pull brings a commit made elsewhere.
    host_git(&origin, &["pull", "-q", &path_str(&bare), "main"]);
    std::fs::write(origin.join("third"), "3\n").unwrap();
    host_git(&origin, &["add", "."]);
    host_git(&origin, &["-c", "user.name=o", "-c", "user.email=o@o", "commit", "-qm", "third"]);
    host_git(&origin, &["push", "-q", &path_str(&bare), "main"]);
    c.call(git(&work, GitOp::Pull { remote: None, branch: None })).await.done();
    assert!(work.join("third").exists());

    // Cloning over a non-empty directory is refused.
    let r = c.call(git(&work, GitOp::Clone { url, branch: None })).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::Conflict));
}

/// Credentials reach git's http client through the in-memory helper, and no process on the
/// machine carries the password in its argv while git is using it.
#[tokio::test]
async fn credentials_are_passed_in_memory() {
    let silkd = Silkd::start();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let password = "s3cret-Pa55-for-silk-test";
    let server = std::thread::spawn(move || {
        let mut seen_auth = None;
        let mut argv_leak = false;
        // Answer 401 until git sends credentials, then 404 (the test needs no real repository).
        for _ in 0..4 {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut auth = None;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.strip_prefix("Authorization: Basic ") {
                    auth = Some(v.trim().to_string());
                }
            }
            argv_leak |= any_cmdline_contains(password);
            let mut stream = stream;
            if let Some(auth) = auth {
                seen_auth = Some(auth);
                let _ = stream.write_all(
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
                break;
            }
            let _ = stream.write_all(
                b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm=\"silk\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            );
        }
        (seen_auth, argv_leak)
    });

    let mut c = silkd.connect().await;
    let r = c
        .call(Frame::Git(GitRequest {
            repo: path_str(&silkd.path("cloned")),
            op: GitOp::Clone { url: format!("http://127.0.0.1:{port}/repo.git"), branch: None },
            user: None,
            credentials: Some(GitCredentials {
                username: "silkuser".into(),
                password: password.into(),
            }),
        }))
        .await;
    assert!(r.error_kind().is_some(), "the fake server has no repository");
    let (auth, argv_leak) = server.join().unwrap();
    assert_eq!(auth.as_deref(), Some(base64(&format!("silkuser:{password}")).as_str()));
    assert!(!argv_leak, "the password appeared in a process's argv");
}

fn any_cmdline_contains(needle: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().filter_map(|e| e.ok()).any(|e| {
        std::fs::read(e.path().join("cmdline"))
            .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle.as_bytes()))
    })
}

fn base64(s: &str) -> String {
    const TABLE: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in s.as_bytes().chunks(3) {
        let n = chunk.iter().fold(0u32, |acc, &b| acc << 8 | b as u32) << (8 * (3 - chunk.len()));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(TABLE[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[tokio::test]
async fn git_errors_are_typed_and_change_nothing() {
    let silkd = Silkd::start();
    let mut c = silkd.connect().await;
    let plain = silkd.path("plain");
    std::fs::create_dir(&plain).unwrap();
    let r = c.call(git(&plain, GitOp::Status { limit: None })).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound), "not a repository");
    let r = c.call(git(&silkd.path("missing"), GitOp::BranchList)).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    assert!(!plain.join(".git").exists());

    let repo = silkd.path("repo");
    std::fs::create_dir(&repo).unwrap();
    host_git(&repo, &["init", "-q", "-b", "main"]);
    let r = c.call(git(&repo, GitOp::BranchCreate { name: "--force".into(), start: None })).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::BadRequest));
    let r = c.call(git(&repo, GitOp::Checkout { branch: "nope".into() })).await;
    assert!(r.error_kind().is_some());
    let r = c.call(git(&repo, GitOp::Commit { message: "empty".into(), author: author() })).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::Conflict), "nothing to commit");
    let r = c.call(git(&repo, GitOp::Add { paths: vec!["no-such-file".into()] })).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::NotFound));
    c.call(Frame::Info).await.done();

    let no_git = Silkd::start_with(&["--git", "/nonexistent/bin/git"]);
    let mut c = no_git.connect().await;
    let r = c.call(git(&repo, GitOp::Status { limit: None })).await;
    assert_eq!(r.error_kind(), Some(ErrorKind::Unsupported));
    c.call(Frame::Info).await.done();
}
