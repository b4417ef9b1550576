//! `scripts/install.sh` (issue 47): installs the binary, the plugin, man pages and shell
//! completions generated from the command line, the systemd units and the example store
//! configuration into a scratch root; the installed binary runs, and `systemd-analyze
//! verify` accepts both units (which name the installed binary).

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

#[test]
fn install_stages_a_working_zdisk_with_man_pages_completions_and_units() {
    if !require(&["systemd-analyze", "install"]) {
        return;
    }
    let s = Scratch::new("install");
    // What a build leaves in target/release, from this test run's build.
    let from = s.path("from");
    std::fs::create_dir(&from).unwrap();
    std::fs::copy(zdisk_bin(), from.join("zdisk")).unwrap();
    std::fs::copy(plugin(), from.join("libnbdkit_zdisk_plugin.so")).unwrap();
    let root = s.path("root");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/install.sh");
    let said = run_ok(Command::new("bash").arg(&script).arg("--from").arg(&from).arg("--destdir").arg(&root));
    assert!(said.contains("installed zdisk"), "{said}");

    let prefix = root.join("usr/local");
    let version = run_ok(Command::new(prefix.join("bin/zdisk")).arg("--version"));
    assert!(version.starts_with("zdisk "), "{version}");
    assert!(prefix.join("lib/zdisk/libnbdkit_zdisk_plugin.so").is_file());
    for page in ["zdisk.1", "zdisk-format.1", "zdisk-serve.1", "zdisk-attach.1", "zdisk-stat.1"] {
        let text = std::fs::read_to_string(prefix.join("share/man/man1").join(page)).unwrap();
        assert!(text.contains(".TH"), "{page} is not a man page");
    }
    let serve_page = std::fs::read_to_string(prefix.join("share/man/man1/zdisk-format.1")).unwrap();
    assert!(serve_page.contains("sparse"), "the format page lacks --sparse: generated from another CLI?");
    for completion in [
        "share/bash-completion/completions/zdisk",
        "share/zsh/site-functions/_zdisk",
        "share/fish/vendor_completions.d/zdisk.fish",
    ] {
        let text = std::fs::read_to_string(prefix.join(completion)).unwrap();
        assert!(text.contains("format") && text.contains("serve"), "{completion} names no commands");
    }
    assert!(root.join("etc/zdisk/example.conf").is_file());

    // The units, against the scratch root (systemd's own units copied in, so their
    // dependencies resolve; the binary they name is the installed one).
    let units = root.join("etc/systemd/system");
    for unit in ["zdisk-serve@.service", "zdisk-attach@.service"] {
        let text = std::fs::read_to_string(units.join(unit)).unwrap();
        assert!(text.contains("ExecStart=/usr/local/bin/zdisk "), "{unit}: {text}");
    }
    std::fs::create_dir_all(root.join("usr/lib/systemd")).unwrap();
    run_ok(Command::new("cp").arg("-r").arg("/usr/lib/systemd/system").arg(root.join("usr/lib/systemd/")));
    let verify = Command::new("systemd-analyze")
        .arg("verify")
        .arg("--man=no")
        .arg(format!("--root={}", root.display()))
        .arg(units.join("zdisk-serve@.service"))
        .arg(units.join("zdisk-attach@.service"))
        .output()
        .unwrap();
    assert_success(&verify, "systemd-analyze verify of the installed units");
}
