/// One fuzz target: a name (KBFS_FUZZ_TARGET, the corpus folder `Fuzz/corpus/NAME`) and
/// what it does with one input. A target must never trap, leak or allocate beyond its limit
/// on any input; wrong input is refused by a thrown error or a nil, which the target drops.
struct FuzzTarget: Sendable {
    let name: String
    let run: @Sendable ([UInt8]) -> Void

    /// Every target, in the order `scripts/fuzz.sh` runs them.
    static let all: [FuzzTarget] = storeFileTargets + contentTargets + journalTargets + deviceTargets + controlTargets
}
