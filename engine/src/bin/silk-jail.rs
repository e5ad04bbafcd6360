//! `silk-jail SPEC.json`: starts one jail from a launch spec (see `silk_engine::jail::launch`),
//! Prints the jail's host pid on success; on failure prints why on stderr and exits 1.
//! `silk-jail --serve` does the same for each spec the engine sends on its stdin (see
//! `silk_engine::jail::launch::serve`): the engine's way, so a start forks instead of exec'ing;
//! it also brings jails back from CRIU images (`silk_engine::jail::launch::restore`).
//! `silk-jail --hold-userns BASE` holds a new user namespace open
//! until stdin closes (the engine makes its sandboxes' user namespace this way). Run by the jail
//! engine, not by people.

fn main() {
    let arg = std::env::args_os().nth(1);
    if arg.as_deref() == Some(std::ffi::OsStr::new("--hold-userns")) {
        let base = std::env::args().nth(2).and_then(|b| b.parse().ok());
        let Some(base) = base else {
            eprintln!("usage: silk-jail --hold-userns BASE_ID");
            std::process::exit(2);
        };
        if let Err(e) = silk_engine::jail::launch::hold_user_namespace(base) {
            eprintln!("silk-jail: {e}");
            std::process::exit(1);
        }
        return;
    }
    if arg.as_deref() == Some(std::ffi::OsStr::new("--serve")) {
        if let Err(e) = silk_engine::jail::launch::serve::serve() {
            eprintln!("silk-jail: {e}");
            std::process::exit(1);
        }
        return;
    }
    let Some(path) = arg else {
        eprintln!("usage: silk-jail SPEC.json");
        std::process::exit(2);
    };
    match silk_engine::jail::launch::run(&read_spec(path), None) {
        Ok(pid) => println!("{pid}"),
        Err(e) => {
            eprintln!("silk-jail: {e}");
            std::process::exit(1);
        }
    }
}

fn read_spec<T: serde::de::DeserializeOwned>(path: std::ffi::OsString) -> T {
    match std::fs::read(&path)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(spec) => spec,
        Err(e) => {
            eprintln!("silk-jail: cannot read {}: {e}", std::path::Path::new(&path).display());
            std::process::exit(2);
        }
    }
}
