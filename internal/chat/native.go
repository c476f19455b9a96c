package chat

// nativeKind sorts a Responses input item's type.
func nativeKind(typ string) NativeKind {
	switch typ {
	case "compaction":
		return NativeCompaction
	case "compaction_trigger":
		return NativeTrigger
	}
	return NativeNone
}

// NativeItem returns the client's bytes of message i of r.Messages (a
// view's message: its Index) when it is a native compaction item or block
// (Native != NativeNone), else nil.
func (r *Request) NativeItem(i int) []byte {
	if r.src == nil || i < 0 || i >= len(r.Messages) || r.Messages[i].Native == NativeNone {
		return nil
	}
	if u := &r.src.units[i]; len(u.items) == 1 {
		return u.items[0]
	}
	return nil
}

// LastNativeCompaction returns the index in r.Messages of the last
// NativeCompaction message, -1 when there is none. The provider reads the
// conversation from there on.
func (r *Request) LastNativeCompaction() int {
	for i := len(r.Messages) - 1; i >= 0; i-- {
		if r.Messages[i].Native == NativeCompaction {
			return i
		}
	}
	return -1
}
