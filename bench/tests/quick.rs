//! `silkbench --quick` as a smoke test: every section runs against real nodes and jails, and
//! every table it prints has rows with numbers in them. Timings are never asserted.

#[test]
fn quick_run_prints_every_table_with_numbers() {
    let silkd = std::env::var_os("SILKD_STATIC")
        .expect("SILKD_STATIC is not set: run the suite through scripts/test");
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_silkbench"));
    for sibling in ["sandboxd", "silk-jail", "sbx"] {
        assert!(
            exe.with_file_name(sibling).is_file(),
            "{sibling} missing next to silkbench: build the workspace (scripts/test does)"
        );
    }
    let out = std::process::Command::new(&exe)
        .arg("--quick")
        .env("SILKD_STATIC", silkd)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "silkbench --quick failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut tables = 0;
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if !line.starts_with("### ") {
            continue;
        }
        tables += 1;
        let rows: Vec<&str> = lines
            .by_ref()
            .skip_while(|l| l.is_empty())
            .take_while(|l| l.starts_with('|'))
            .skip(2)
            .collect();
        assert!(!rows.is_empty(), "table {line:?} has no rows");
        for row in rows {
            assert!(
                row.chars().any(|c| c.is_ascii_digit()),
                "row without a number in {line:?}: {row}"
            );
        }
    }
    for section in [
        "## silkd agent",
        "## silkd verbs",
        "## jail engine",
        "## claims journal",
        "## node",
        "## fleet",
        "## SDK",
        "## store",
    ] {
        assert!(text.contains(section), "section {section} missing");
    }
    assert!(tables >= 15, "only {tables} tables");
}
