//! The sandbox's seccomp filter: an allow-by-default list no looser than Docker's default
//! profile for a container without `CAP_SYS_ADMIN`/`CAP_SYS_PTRACE` (moby/profiles seccomp
//! v0.2.3; the comparison is a table in docs/engine.md). It refuses with `EPERM` the system calls
//! that reach past the sandbox's namespaces — kernel modules, kexec, reboot, mounts (old and new
//! API), keyrings, bpf, perf, swap, clock setting, io_uring, namespaces, NUMA placement,
//! `pidfd_getfd`/`kcmp` — and filters arguments like Docker: `clone` with namespace flags,
//! `socket(AF_VSOCK)` (vsock ignores network namespaces) and `AF_ALG`, `personality` beyond
//! Docker's five values. Numbers newer than the filter answer `ENOSYS`. Other architectures'
//! system calls kill the process. Built by hand as classic BPF (the refused numbers as a
//! binary search, 125 instructions) rather than with a crate.

use libc::{sock_filter, sock_fprog};

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
/// `offsetof(struct seccomp_data, ...)`.
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const OFF_ARG0_LO: u32 = 16;

const SYS_SOCKET: u32 = 41;
const SYS_CLONE: u32 = 56;
const SYS_PERSONALITY: u32 = 135;
const SYS_CLONE3: u32 = 435;

/// Highest x86_64 syscall number this filter was written against (467 = open_tree_attr).
/// Anything above it answers ENOSYS, as runc does for numbers past the profile's last.
const LAST_KNOWN_NR: u32 = 467;

/// CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET: Docker's clone mask.
const CLONE_NS_FLAGS: u32 = 0x7e02_0000;

/// socket(2) families refused (compared on the low 32 bits: the kernel takes an `int`).
const AF_ALG: u32 = 38;
const AF_VSOCK: u32 = 40;

/// personality(2) values allowed (Docker's list): PER_LINUX, PER_LINUX32, UNAME26,
/// PER_LINUX32|UNAME26, and 0xffffffff (query). Low 32 bits: the kernel takes `unsigned int`.
const PERSONALITY_ALLOWED: &[u32] =
    &[0x0000_0000, 0x0000_0008, 0x0002_0000, 0x0002_0008, 0xffff_ffff];

/// Refused with EPERM (x86_64 numbers).
const BLOCKED: &[u32] = &[
    103, // syslog
    134, // uselib
    136, // ustat
    139, // sysfs
    153, // vhangup
    155, // pivot_root
    156, // _sysctl
    159, // adjtimex            (Docker allows; we are stricter)
    163, // acct
    164, // settimeofday
    165, // mount
    166, // umount2
    167, // swapon
    168, // swapoff
    169, // reboot
    170, // sethostname         (new)
    171, // setdomainname       (new)
    172, // iopl
    173, // ioperm
    174, // create_module
    175, // init_module
    176, // delete_module
    177, // get_kernel_syms
    178, // query_module
    179, // quotactl
    180, // nfsservctl
    212, // lookup_dcookie
    227, // clock_settime
    237, // mbind               (new)
    238, // set_mempolicy       (new)
    239, // get_mempolicy       (new)
    246, // kexec_load
    248, // add_key
    249, // request_key
    250, // keyctl
    256, // migrate_pages       (new)
    272, // unshare
    279, // move_pages          (new)
    298, // perf_event_open
    300, // fanotify_init       (new)
    303, // name_to_handle_at   (Docker allows; we are stricter)
    304, // open_by_handle_at
    305, // clock_adjtime       (Docker allows; we are stricter)
    308, // setns
    312, // kcmp                (new)
    313, // finit_module
    320, // kexec_file_load
    321, // bpf
    323, // userfaultfd
    425, // io_uring_setup
    426, // io_uring_enter
    427, // io_uring_register
    428, // open_tree
    429, // move_mount
    430, // fsopen
    431, // fsconfig
    432, // fsmount
    433, // fspick
    438, // pidfd_getfd         (new)
    440, // process_madvise     (new)
    442, // mount_setattr
    443, // quotactl_fd         (new)
    450, // set_mempolicy_home_node (new)
    459, // lsm_get_self_attr   (new)
    460, // lsm_set_self_attr   (new)
    461, // lsm_list_modules    (new)
    467, // open_tree_attr      (new)
];

const LD_W_ABS: u32 = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
const JEQ_K: u32 = libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K;
const JGT_K: u32 = libc::BPF_JMP | libc::BPF_JGT | libc::BPF_K;
const JGE_K: u32 = libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K;
const JSET_K: u32 = libc::BPF_JMP | libc::BPF_JSET | libc::BPF_K;
const RET_K: u32 = libc::BPF_RET | libc::BPF_K;

/// Jump targets, resolved once the layout is known (classic BPF only jumps forward).
#[derive(Clone, Copy, PartialEq, Eq)]
enum To {
    Next,
    /// Over the next this many instructions.
    Over(usize),
    CloneCheck,
    SocketCheck,
    PersonalityCheck,
    Allow,
    Eperm,
    Enosys,
    Kill,
}

/// The filter program.
pub fn program() -> Vec<sock_filter> {
    use To::*;
    let mut ins: Vec<(u32, u32, To, To)> = Vec::new();
    let mut at: Vec<(To, usize)> = Vec::new();

    ins.push((LD_W_ABS, OFF_ARCH, Next, Next));
    ins.push((JEQ_K, AUDIT_ARCH_X86_64, Next, Kill));
    ins.push((LD_W_ABS, OFF_NR, Next, Next));
    ins.push((JGE_K, X32_SYSCALL_BIT, Eperm, Next));
    ins.push((JGT_K, LAST_KNOWN_NR, Enosys, Next));
    ins.push((JEQ_K, SYS_CLONE, CloneCheck, Next));
    // clone3 passes flags in memory the filter cannot read: answer ENOSYS so libc uses clone.
    ins.push((JEQ_K, SYS_CLONE3, Enosys, Next));
    ins.push((JEQ_K, SYS_SOCKET, SocketCheck, Next));
    ins.push((JEQ_K, SYS_PERSONALITY, PersonalityCheck, Next));
    let mut blocked = BLOCKED.to_vec();
    blocked.sort_unstable();
    search(&mut ins, &blocked);

    at.push((CloneCheck, ins.len()));
    ins.push((LD_W_ABS, OFF_ARG0_LO, Next, Next));
    ins.push((JSET_K, CLONE_NS_FLAGS, Eperm, Allow));

    at.push((SocketCheck, ins.len()));
    ins.push((LD_W_ABS, OFF_ARG0_LO, Next, Next));
    ins.push((JEQ_K, AF_ALG, Eperm, Next));
    ins.push((JEQ_K, AF_VSOCK, Eperm, Allow));

    at.push((PersonalityCheck, ins.len()));
    ins.push((LD_W_ABS, OFF_ARG0_LO, Next, Next));
    for (i, v) in PERSONALITY_ALLOWED.iter().enumerate() {
        let miss = if i + 1 == PERSONALITY_ALLOWED.len() { Eperm } else { Next };
        ins.push((JEQ_K, *v, Allow, miss));
    }

    at.push((Allow, ins.len()));
    ins.push((RET_K, SECCOMP_RET_ALLOW, Next, Next));
    at.push((Eperm, ins.len()));
    ins.push((RET_K, SECCOMP_RET_ERRNO | libc::EPERM as u32, Next, Next));
    at.push((Enosys, ins.len()));
    ins.push((RET_K, SECCOMP_RET_ERRNO | libc::ENOSYS as u32, Next, Next));
    at.push((Kill, ins.len()));
    ins.push((RET_K, SECCOMP_RET_KILL_PROCESS, Next, Next));

    let offset = |from: usize, to: To| -> u8 {
        match to {
            Next => return 0,
            Over(n) => return u8::try_from(n).expect("a subtree fits in a jump"),
            _ => {}
        }
        let target = at.iter().find(|(l, _)| *l == to).expect("label placed").1;
        u8::try_from(target - from - 1).expect("filter jumps are forward and fit in u8")
    };
    ins.iter()
        .enumerate()
        .map(|(i, &(code, k, jt, jf))| sock_filter {
            code: code as u16,
            jt: offset(i, jt),
            jf: offset(i, jf),
            k,
        })
        .collect()
}

/// The refused numbers `sorted` (ascending) as a binary search that ends in `Eperm` for each of
/// them and allows every other number. The kernel runs the filter once for every system call
/// number when it is installed (to cache the numbers always allowed), on every jail's start:
/// a search there instead of a list of 66 comparisons made that 4× shorter.
fn search(ins: &mut Vec<(u32, u32, To, To)>, sorted: &[u32]) {
    if sorted.len() <= 4 {
        for nr in sorted {
            ins.push((JEQ_K, *nr, To::Eperm, To::Next));
        }
        ins.push((RET_K, SECCOMP_RET_ALLOW, To::Next, To::Next));
        return;
    }
    let (below, from) = sorted.split_at(sorted.len() / 2);
    let fork = ins.len();
    ins.push((JGE_K, from[0], To::Next, To::Next));
    search(ins, below);
    ins[fork].2 = To::Over(ins.len() - fork - 1);
    search(ins, from);
}

/// Installs the filter on the calling thread (and what it execs). `no_new_privs` must be set.
/// Async-signal-safe apart from the allocation in `program`, so call it before `fork` or in a
/// single-threaded process.
pub fn install(filter: &[sock_filter]) -> std::io::Result<()> {
    let prog = sock_fprog { len: filter.len() as u16, filter: filter.as_ptr() as *mut sock_filter };
    // SAFETY: `prog` points at a valid filter that outlives the call.
    let rc = unsafe {
        libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const sock_fprog)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_jump_lands_inside_the_program() {
        let p = program();
        for (i, ins) in p.iter().enumerate() {
            if u32::from(ins.code) & 0x07 == libc::BPF_JMP {
                assert!(i + 1 + (ins.jt as usize) < p.len());
                assert!(i + 1 + (ins.jf as usize) < p.len());
            }
        }
        assert!(p.len() < 256, "jumps are one byte");
    }

    /// What the filter answers for `nr` with `arg0`, by a classic BPF interpreter of the
    /// instructions it uses.
    fn run(p: &[sock_filter], arch: u32, nr: u32, arg0: u64) -> u32 {
        let mut data = [0u8; 64];
        data[0..4].copy_from_slice(&nr.to_ne_bytes());
        data[4..8].copy_from_slice(&arch.to_ne_bytes());
        data[16..24].copy_from_slice(&arg0.to_ne_bytes());
        let (mut pc, mut a) = (0usize, 0u32);
        loop {
            let ins = p[pc];
            let code = u32::from(ins.code);
            pc += 1;
            let jump = |taken: bool| usize::from(if taken { ins.jt } else { ins.jf });
            match code {
                LD_W_ABS => {
                    let k = ins.k as usize;
                    a = u32::from_ne_bytes(data[k..k + 4].try_into().unwrap());
                }
                JEQ_K => pc += jump(a == ins.k),
                JGT_K => pc += jump(a > ins.k),
                JGE_K => pc += jump(a >= ins.k),
                JSET_K => pc += jump(a & ins.k != 0),
                RET_K => return ins.k,
                other => panic!("opcode {other:#x} not interpreted"),
            }
        }
    }

    #[test]
    fn the_filter_answers_every_system_call_as_its_rules_say() {
        let p = program();
        let eperm = SECCOMP_RET_ERRNO | libc::EPERM as u32;
        let enosys = SECCOMP_RET_ERRNO | libc::ENOSYS as u32;
        for nr in 0..=LAST_KNOWN_NR + 10 {
            let want = if nr > LAST_KNOWN_NR || nr == SYS_CLONE3 {
                enosys
            } else if BLOCKED.contains(&nr) {
                eperm
            } else {
                SECCOMP_RET_ALLOW
            };
            let arg0 = match nr {
                SYS_PERSONALITY => 0x8, // PER_LINUX32: allowed
                _ => 0,
            };
            assert_eq!(run(&p, AUDIT_ARCH_X86_64, nr, arg0), want, "syscall {nr}");
        }
        assert_eq!(run(&p, AUDIT_ARCH_X86_64, X32_SYSCALL_BIT | 1, 0), eperm, "x32");
        assert_eq!(run(&p, 0x4000_0003, 1, 0), SECCOMP_RET_KILL_PROCESS, "i386");
        let ns = u64::from(CLONE_NS_FLAGS & CLONE_NS_FLAGS.wrapping_neg()); // one namespace flag
        assert_eq!(
            run(&p, AUDIT_ARCH_X86_64, SYS_CLONE, ns | 0x11),
            eperm,
            "clone into a namespace"
        );
        assert_eq!(run(&p, AUDIT_ARCH_X86_64, SYS_CLONE, 0x11), SECCOMP_RET_ALLOW, "plain clone");
        for (family, want) in [(1, SECCOMP_RET_ALLOW), (AF_ALG, eperm), (AF_VSOCK, eperm)] {
            assert_eq!(run(&p, AUDIT_ARCH_X86_64, SYS_SOCKET, family.into()), want, "{family}");
        }
        assert_eq!(run(&p, AUDIT_ARCH_X86_64, SYS_PERSONALITY, 0x0040_0000), eperm);
    }
}
